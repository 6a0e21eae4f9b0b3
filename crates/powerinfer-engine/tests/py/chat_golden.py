#!/usr/bin/env python3
"""Renders chat templates as Hugging Face's `apply_chat_template` does and writes the results.

transformers compiles a chat template with jinja2's ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True, extensions=[loopcontrols]), a `raise_exception` global and a `tojson` filter,
and renders it with `messages`, `add_generation_prompt`, `bos_token`, `eos_token`. This script does
the same for the templates in tests/data/chat/templates.json (real templates of Hugging Face models,
as llama.cpp's test-chat-template.cpp carries them, and the named templates of our engine) over a
few conversations, and writes tests/data/chat/golden.json: one case per (template, conversation,
add_generation_prompt) with the rendered text, or the exception a template raised.

Usage: python chat_golden.py TEMPLATES.json OUT.json   (needs jinja2; made with jinja2 3.1.6)
"""
import json
import sys

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

CONVERSATIONS = {
    "system_multi_turn": [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there"},
        {"role": "user", "content": "Who are you"},
        {"role": "assistant", "content": "   I am an assistant   "},
        {"role": "user", "content": "Another question"},
    ],
    "user_only": [{"role": "user", "content": "What is 2 + 2?"}],
    "user_assistant_user": [
        {"role": "user", "content": "Tell me a joke"},
        {"role": "assistant", "content": "Why did the neuron stay sparse? It was not activated."},
        {"role": "user", "content": "Another, please\nwith a newline"},
    ],
}


def raise_exception(message):
    raise TemplateError(message)


def render(template, bos, eos, messages, add_generation_prompt):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    t = env.from_string(template)
    return t.render(messages=messages, add_generation_prompt=add_generation_prompt,
                    bos_token=bos, eos_token=eos)


def main():
    templates = json.load(open(sys.argv[1]))
    cases = []
    for t in templates:
        for conv_name, messages in CONVERSATIONS.items():
            for agp in (True, False):
                case = {"template": t["name"], "conversation": conv_name, "add_generation_prompt": agp}
                try:
                    case["output"] = render(t["template"], t["bos"], t["eos"], messages, agp)
                except TemplateError as e:
                    case["error"] = str(e)
                cases.append(case)
    json.dump({"conversations": CONVERSATIONS, "cases": cases}, open(sys.argv[2], "w"),
              indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
