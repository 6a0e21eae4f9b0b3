#!/usr/bin/env python3
"""The official `openai` package against `powerinfer serve`: chat and completions, streamed and
not. Usage: openai_client.py BASE_URL MODEL_ID [API_KEY]. Prints one JSON object of what it saw;
exits non-zero on any failure."""
import json
import sys

from openai import OpenAI


def main():
    base, model = sys.argv[1], sys.argv[2]
    key = sys.argv[3] if len(sys.argv) > 3 else "none"
    client = OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)
    out = {}

    models = client.models.list()
    out["models"] = [m.id for m in models.data]
    assert model in out["models"], out["models"]

    c = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8,
                                  temperature=0, seed=3)
    out["completion"] = c.choices[0].text
    assert c.usage.completion_tokens == 8 and c.usage.prompt_tokens > 0, c.usage
    assert c.choices[0].finish_reason == "length"

    pieces = []
    last = None
    for chunk in client.completions.create(model=model, prompt="Once upon a time",
                                           max_tokens=8, temperature=0, seed=3, stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            last = chunk
    out["completion_stream"] = "".join(pieces)
    assert out["completion_stream"] == out["completion"], out
    assert last.choices[0].finish_reason == "length"

    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                       temperature=0, seed=1)
    out["chat"] = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    deltas = []
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                                temperature=0, seed=1, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            deltas.append(chunk.choices[0].delta.content)
    out["chat_stream"] = "".join(deltas)
    assert out["chat_stream"] == out["chat"], out
    assert len(deltas) >= 2, deltas

    try:
        client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=2)
        raise AssertionError("an unknown model was accepted")
    except Exception as e:  # openai.NotFoundError
        out["unknown_model"] = type(e).__name__
        assert "NotFound" in type(e).__name__, type(e).__name__
    print(json.dumps(out))


if __name__ == "__main__":
    main()
