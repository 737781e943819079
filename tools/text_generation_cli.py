#!/usr/bin/env python
"""Megatron-LM's interactive client (``tools/text_generation_cli.py``, core 0.20.0), re-created on
the standard library: ``python tools/text_generation_cli.py HOST:PORT``.

It asks for a prompt and a number of tokens, sends ``PUT http://HOST:PORT/api`` with JSON
``{"prompts": [prompt], "tokens_to_generate": n}`` and prints ``Megatron Response:`` and
``text[0]``, or ``Error STATUS: message`` (the server's ``{"message": ...}``); it loops until end of
input. Megatron's reads the count with ``ast.literal_eval``; so does this one.
"""

from __future__ import annotations

import ast
import json
import sys
import urllib.error
import urllib.request


def put(url: str, data: dict, timeout: float = 600.0) -> tuple[int, dict]:
    """(status, decoded JSON body) of ``PUT url`` with ``data`` as JSON."""
    req = urllib.request.Request(url, data=json.dumps(data).encode(), method="PUT",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            return e.code, json.loads(body)
        except ValueError:
            return e.code, {"message": body.decode(errors="replace")}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: text_generation_cli.py HOST:PORT")
    url = "http://" + argv[0] + "/api"
    while True:
        try:
            sentence = input("Enter prompt: ")
            tokens_to_generate = ast.literal_eval(input("Enter number of tokens to generate: "))
        except EOFError:
            return
        status, body = put(url, {"prompts": [sentence], "tokens_to_generate": tokens_to_generate})
        if status != 200:
            print(f"Error {status}: {body.get('message') if isinstance(body, dict) else body}")
        else:
            print("Megatron Response: ")
            print(body["text"][0])


if __name__ == "__main__":
    main()
