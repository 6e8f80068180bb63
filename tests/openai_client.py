#!/usr/bin/env python3
"""mlb-serve through the official `openai` Python client: models, chat, chat streaming,
completions, completions streaming, logprobs, embeddings (the client's default base64
and floats), structured output (`response_format` with a JSON schema, also as a pydantic
model through `parse`, and `json_object`), tool calls (`tool_choice` required, named and
auto, parallel calls, pydantic tools, the stream helper's accumulated calls, a tool result
sent back), and errors raised as the client's typed exceptions.

    python tests/openai_client.py [BIN_DIR]

BIN_DIR holds mlb-serve, mlb-convert and mlt-convert (default: target/debug). The script
converts the bundled default model (testdata/default) with a chat template into a
temporary folder, starts mlb-serve on a free port with an API key, runs the client
against it, then stops the server with SIGTERM and expects exit status 0. `.ci/run`
runs it in a virtual environment of its own (python3 -m venv; pip install openai).
Exit status 0 when every check passes.
"""

import json
import pathlib
import signal
import subprocess
import sys
import tempfile

from typing import List, Literal

import openai
import pydantic

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The template the tests give the default model; its end of turn is the EOS.
TEMPLATE = (
    "{% for m in messages %}<|startoftext|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|startoftext|>assistant\n{% endif %}"
)
KEY = "test-key"


def run(*args):
    subprocess.run([str(a) for a in args], check=True, stdout=subprocess.DEVNULL)


def check(name, ok, detail=""):
    if not ok:
        raise AssertionError(f"{name}: {detail}")
    print(f"ok  {name}")


def stream_text(chunks, chat):
    text, finish, usage = "", None, None
    for c in chunks:
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            part = ch.delta.content if chat else ch.text
            text += part or ""
            finish = ch.finish_reason or finish
    return text, finish, usage


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)
    tags: List[Literal["a", "b", "c"]] = pydantic.Field(max_length=3)
    ok: bool


class GetWeather(pydantic.BaseModel):
    """Weather in a city."""

    city: str = pydantic.Field(max_length=8)
    unit: Literal["c", "f"]


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "now", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}},
]


def weather_args(arguments):
    a = json.loads(arguments)
    return set(a) == {"city", "unit"} and len(a["city"]) <= 8 and a["unit"] in ("c", "f")


def structured(client):
    """response_format: every answer parses and validates (the model has random weights:
    the grammar decides what can come out)."""
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    for seed in (1, 2):
        r = client.chat.completions.parse(
            model="default", messages=messages, response_format=Person, max_tokens=200, seed=seed, temperature=1,
        )
        m = r.choices[0].message
        check(f"parse json_schema (pydantic, strict) seed {seed}",
              r.choices[0].finish_reason == "stop" and isinstance(m.parsed, Person), m)
        # Streamed: the same seed, the same text.
        with client.chat.completions.stream(
            model="default", messages=messages, response_format=Person, max_tokens=200, seed=seed, temperature=1,
        ) as s:
            final = s.get_final_completion()
        check(f"stream json_schema seed {seed}",
              final.choices[0].message.content == m.content and final.choices[0].message.parsed == m.parsed,
              (final, m))
    # A schema as a dict (with no other keys allowed: else a random model writes
    # strings under keys of its own until max_tokens).
    schema = dict(Person.model_json_schema(), additionalProperties=False)
    r = client.chat.completions.create(
        model="default", messages=messages, max_tokens=200, seed=3, temperature=1,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": schema}},
    )
    check("json_schema dict", r.choices[0].finish_reason == "stop"
          and Person.model_validate_json(r.choices[0].message.content) is not None, r)
    r = client.chat.completions.create(
        model="default", messages=messages, max_tokens=12, seed=1, temperature=1,
        response_format={"type": "json_object"},
    )
    check("json_object", (r.choices[0].message.content or "").startswith("{"), r)
    try:
        client.chat.completions.create(
            model="default", messages=messages, max_tokens=10,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}},
        )
        check("bad schema refused", False, "no error")
    except openai.BadRequestError as e:
        check("bad schema refused", e.body.get("param") == "response_format" and "frobnicate" in e.message, e.body)


def tool_calls(client):
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(
            model="default", messages=messages, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
            max_tokens=200, seed=1, temperature=1,
        )
        c = r.choices[0]
        calls = c.message.tool_calls or []
        check(f"tool_choice {choice}",
              c.finish_reason == "tool_calls" and len(calls) == 1 and calls[0].type == "function"
              and calls[0].id.startswith("call_") and c.message.content is None
              and (calls[0].function.name == "now" and json.loads(calls[0].function.arguments) == {}
                   or weather_args(calls[0].function.arguments))
              and (choice == "required" or calls[0].function.name == "get_weather"), r)
        # The stream helper adds the deltas up to the same calls.
        with client.chat.completions.stream(
            model="default", messages=messages, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
            max_tokens=200, seed=1, temperature=1,
        ) as s:
            final = s.get_final_completion()
        fc = final.choices[0]
        check(f"tool_choice {choice} streamed",
              fc.finish_reason == "tool_calls"
              and [(t.function.name, t.function.arguments) for t in fc.message.tool_calls]
              == [(t.function.name, t.function.arguments) for t in calls], (final, r))
    # The call and its result sent back: the conversation renders.
    r2 = client.chat.completions.create(
        model="default", tools=TOOLS, max_tokens=4, temperature=0,
        messages=messages + [c.message, {"role": "tool", "tool_call_id": calls[0].id, "content": "{\"temp\": 3}"}],
    )
    check("tool result sent back", r2.choices[0].message.content is not None, r2)
    # Pydantic tools through parse: the arguments come back as the model's instance.
    r = client.chat.completions.parse(
        model="default", messages=messages, tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required", parallel_tool_calls=False, max_tokens=200, seed=2, temperature=1,
    )
    pa = r.choices[0].message.tool_calls[0].function.parsed_arguments
    check("pydantic tool parsed", isinstance(pa, GetWeather), r)
    # tool_choice auto: calls are read out of the reply's text (a grammar makes this
    # random model write two, as Qwen's and Hermes' templates ask: <tool_call> tags).
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    two = "start: " + json.dumps("Checking. " + call + "\n" + call.replace("Oslo", "Bergen"))
    r = client.chat.completions.create(
        model="default", messages=messages, tools=TOOLS, tool_choice="auto", max_tokens=150,
        extra_body={"grammar": two},
    )
    c = r.choices[0]
    got = [(t.function.name, json.loads(t.function.arguments)["city"]) for t in c.message.tool_calls or []]
    check("tool_choice auto: parallel calls read out of the text",
          c.finish_reason == "tool_calls" and c.message.content == "Checking."
          and got == [("get_weather", "Oslo"), ("get_weather", "Bergen")]
          and len({t.id for t in c.message.tool_calls}) == 2, r)
    chunks = list(client.chat.completions.create(
        model="default", messages=messages, tools=TOOLS, tool_choice="auto", max_tokens=150,
        extra_body={"grammar": two}, stream=True,
    ))
    args = {}
    for ch in chunks:
        for d in ch.choices[0].delta.tool_calls or []:
            args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
    check("tool_choice auto streamed",
          [json.loads(args[i])["city"] for i in sorted(args)] == ["Oslo", "Bergen"]
          and chunks[-1].choices[0].finish_reason == "tool_calls", chunks)
    try:
        client.chat.completions.create(model="default", messages=messages, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
        check("unknown tool refused", False, "no error")
    except openai.BadRequestError as e:
        check("unknown tool refused", e.body.get("param") == "tool_choice.function.name", e.body)


def exercise(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    models = client.models.list()
    check("models", [m.id for m in models.data] == ["default"], models)
    check("models: context_length", models.data[0].context_length > 0, models)

    messages = [
        {"role": "system", "content": "You answer."},
        {"role": "user", "content": "What is a list?"},
    ]
    r = client.chat.completions.create(model="default", messages=messages, max_tokens=12, temperature=0)
    c = r.choices[0]
    check(
        "chat",
        r.object == "chat.completion" and c.message.role == "assistant"
        and c.finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
        and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens,
        r,
    )
    chunks = list(
        client.chat.completions.create(
            model="default", messages=messages, max_tokens=12, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )
    )
    text, finish, usage = stream_text(chunks, chat=True)
    check(
        "chat stream",
        text == (c.message.content or "") and finish == c.finish_reason
        and usage is not None and usage.completion_tokens == r.usage.completion_tokens
        and chunks[0].choices[0].delta.role == "assistant",
        (text, c.message.content, finish, usage),
    )

    r = client.chat.completions.create(
        model="default", messages=messages, max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=2, logit_bias={"2": -100},
    )
    lp = r.choices[0].logprobs.content
    check(
        "chat logprobs",
        len(lp) == 3 and all(len(t.top_logprobs) == 2 and t.logprob == t.top_logprobs[0].logprob for t in lp),
        lp,
    )

    p = client.completions.create(model="default", prompt="A function is", max_tokens=12, temperature=0)
    pc = p.choices[0]
    check(
        "completions",
        p.object == "text_completion" and pc.finish_reason in ("stop", "length")
        and p.usage.completion_tokens >= 1,
        p,
    )
    chunks = list(
        client.completions.create(model="default", prompt="A function is", max_tokens=12, temperature=0, stream=True)
    )
    text, finish, _ = stream_text(chunks, chat=False)
    check("completions stream", text == pc.text and finish == pc.finish_reason, (text, pc.text))

    s = client.completions.create(model="default", prompt="A function is", max_tokens=12, temperature=0, stop=[pc.text[3:5]])
    check(
        "stop string",
        pc.text[3:5] == "" or (s.choices[0].finish_reason == "stop" and s.choices[0].text == pc.text[: pc.text.find(pc.text[3:5])]),
        (s, pc.text),
    )

    e = client.embeddings.create(model="default", input=["A function is", "A list"])
    v = e.data[0].embedding
    check(
        "embeddings",
        e.object == "list" and len(e.data) == 2 and [d.index for d in e.data] == [0, 1]
        and len(v) == len(e.data[1].embedding) and len(v) > 0
        and abs(sum(x * x for x in v) - 1.0) < 1e-4
        and e.usage.prompt_tokens > 0 and e.usage.total_tokens == e.usage.prompt_tokens,
        e,
    )
    f = client.embeddings.create(model="default", input="A function is", encoding_format="float")
    check(
        "embeddings as floats",
        len(f.data) == 1 and all(abs(a - b) < 1e-6 for a, b in zip(f.data[0].embedding, v)),
        f,
    )
    d = client.embeddings.create(model="default", input=[[1, 2, 3]], dimensions=8)
    check("embeddings of ids, 8 dimensions", len(d.data[0].embedding) == 8, d)
    try:
        client.embeddings.create(model="default", input=["x"] * 2049)
        check("2049 embedding inputs refused", False, "no error")
    except openai.BadRequestError as e:
        check("2049 embedding inputs refused", e.status_code == 400 and e.body.get("param") == "input", e.body)
    structured(client)
    tool_calls(client)

    try:
        client.chat.completions.create(model="default", messages=messages, max_tokens=0)
        check("max_tokens 0 refused", False, "no error")
    except openai.BadRequestError as e:
        check("max_tokens 0 refused", e.status_code == 400 and e.body.get("param") == "max_tokens", e.body)
    try:
        client.completions.create(model="default", prompt="word " * 400)
        check("prompt too long refused", False, "no error")
    except openai.BadRequestError as e:
        check("prompt too long refused", e.code == "context_length_exceeded", e.body)
    try:
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        check("wrong key refused", False, "no error")
    except openai.AuthenticationError as e:
        check("wrong key refused", e.status_code == 401 and e.code == "invalid_api_key", e.body)


def main():
    bins = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "target" / "debug"
    src = ROOT / "testdata" / "default"
    with tempfile.TemporaryDirectory() as tmp:
        d = pathlib.Path(tmp)
        (d / "template.jinja").write_text(TEMPLATE)
        run(bins / "mlb-convert", src, "-o", d / "default.mlb")
        run(bins / "mlt-convert", src / "tokenizer.json", "-o", d / "default.mlt", "--chat-template", d / "template.jinja", "-q")
        with open(d / "server.log", "w") as log:
            server = subprocess.Popen(
                [str(bins / "mlb-serve"), str(d / "default.mlb"), "--port", "0", "--parallel", "2", "--api-key", KEY],
                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True,
            )
            try:
                line = server.stdout.readline().strip()
                if not line.startswith("listening on http://"):
                    raise AssertionError(f"mlb-serve did not start: {line!r}\n{(d / 'server.log').read_text()}")
                exercise(line[len("listening on "):])
                server.send_signal(signal.SIGTERM)
                code = server.wait(timeout=60)
                check("SIGTERM: exit 0", code == 0, (code, (d / "server.log").read_text()))
            finally:
                if server.poll() is None:
                    server.kill()
                    server.wait()
    print("openai client against mlb-serve: all checks ok")


if __name__ == "__main__":
    main()
