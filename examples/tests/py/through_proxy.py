#!/usr/bin/env python3
"""Sequential `openai` chat requests through a proxy: prints one line per request
(`ok <text>` or `fail <error>`), flushed, so a caller can act mid-run.
Usage: through_proxy.py BASE_URL MODEL_ID N"""
import sys

from openai import OpenAI


def main():
    base, model, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
    for i in range(n):
        try:
            r = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"request {i}"}],
                max_tokens=8, temperature=0)
            print("ok", repr(r.choices[0].message.content), flush=True)
        except Exception as e:
            print("fail", type(e).__name__, e, flush=True)


if __name__ == "__main__":
    main()
