"""Request templates: a row in, a request body out; every failure a clear RowError / TemplateError."""

from __future__ import annotations

import datetime
import decimal
import json

import pytest

from batchinfer.datasets.templates import RequestTemplate, RowError, TemplateError


def prompt(text: str, prompt_as: str = "messages", name: str = "t.jinja") -> RequestTemplate:
    return RequestTemplate.from_text(text, name=name, prompt_as=prompt_as)


@pytest.mark.parametrize(("prompt_as", "body"), [
    ("messages", {"messages": [{"role": "user", "content": "Summarise: héllo"}]}),
    ("prompt", {"prompt": "Summarise: héllo"}),
    ("input", {"input": "Summarise: héllo"}),
])
def test_prompt_template_renders_the_body_of_each_prompt_as(prompt_as, body):
    t = prompt("Summarise: {{ title }}\n", prompt_as)
    assert t.columns == frozenset({"title"})
    assert t.render({"title": "héllo"}) == body
    assert json.loads(t.render_json({"title": "héllo"})) == body
    assert "héllo" in t.render_json({"title": "héllo"})  # not \\u-escaped


def test_auto_must_be_resolved_before_rendering():
    t = prompt("{{ x }}", "auto")
    with pytest.raises(ValueError, match="resolved"):
        t.render({"x": "a"})
    assert t.with_prompt_as("prompt").render({"x": "a"}) == {"prompt": "a"}
    assert t.prompt_as == "auto"  # with_prompt_as gives a new template
    with pytest.raises(ValueError, match="prompt_as must be one of"):
        t.with_prompt_as("chat")
    with pytest.raises(ValueError, match="kind must be one of"):
        RequestTemplate.from_text("x", "prompts")


def test_columns_are_the_variables_read_not_set_nor_globals():
    t = prompt("{% set n = 2 %}{% for i in range(n) %}{{ loop.index }}{{ a }}{% endfor %}{{ b.c }}"
               "{{ d | default('') }}")
    assert t.columns == frozenset({"a", "b", "d"})


def test_a_null_fails_naming_the_column_and_line_but_default_and_defined_work():
    t = prompt("Title: {{ title }}\nBody: {{ body }}")
    with pytest.raises(RowError, match=r"t.jinja line 2: column 'body' is null"):
        t.render({"title": "a", "body": None})
    ok = prompt("{{ body | default('none') }}|{% if body is defined %}B{% endif %}|"
                "{{ n | default(none) | tojson }}")
    assert ok.render({"body": None, "n": None}) == {"messages": [{"role": "user", "content": "none||null"}]}


def test_a_missing_column_fails_listing_the_columns():
    t = prompt("{{ titel }}")
    with pytest.raises(RowError, match=r"no column 'titel' \(columns: body, title\)"):
        t.render({"title": "a"}, columns=["title", "body"])
    with pytest.raises(RowError, match=r"no column 'titel' \(columns: title\)"):
        t.render({"title": "a"})


@pytest.mark.parametrize(("value", "kind"), [(["a", "b"], "a list"), ({"k": 1}, "a dict"), (b"xy", "bytes")])
def test_a_list_dict_or_bytes_value_must_be_written_explicitly(value, kind):
    t = prompt("line one\n{{ tags }}")
    match = rf"t.jinja line 2: column 'tags' is {kind}: write it with \|tojson or \|join"
    with pytest.raises(RowError, match=match):
        t.render({"tags": value})
    if kind == "a list":
        assert prompt("{{ tags | join(', ') }}").render({"tags": value})["messages"][0]["content"] == "a, b"


def test_tojson_is_plain_json_and_writes_dates_and_decimals():
    t = prompt("{{ x | tojson }}", "prompt")
    row = {"x": {"s": "<a&b>é", "d": datetime.date(2026, 12, 3), "p": decimal.Decimal("1.50"),
                 "t": datetime.datetime(2026, 12, 3, 4, 5, 6)}}
    text = t.render(row)["prompt"]
    assert text == '{"s": "<a&b>é", "d": "2026-12-03", "p": "1.50", "t": "2026-12-03T04:05:06"}'


def test_body_template_renders_a_json_object():
    t = RequestTemplate.from_text(
        '{"messages": [{"role": "system", "content": "Be brief."},\n'
        '              {"role": "user", "content": {{ q | tojson }}}],\n'
        ' "max_tokens": {{ n }}, "temperature": 0, "response_format": {"type": "json_object"}}',
        "body", name="b.jinja")
    assert t.columns == frozenset({"q", "n"})
    body = t.render({"q": 'say "hi"', "n": 16})
    assert body["messages"][1] == {"role": "user", "content": 'say "hi"'}
    assert body["max_tokens"] == 16 and body["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize(("text", "match"), [
    ('{"prompt": {{ q }}}', "b.jinja: the rendered body is not JSON"),  # q unquoted
    ("[{{ q | tojson }}]", "b.jinja: the rendered body is a JSON list, not an object"),
    ("", "b.jinja: the rendered body is not JSON"),
])
def test_body_template_that_is_not_a_json_object_fails_per_row(text, match):
    t = RequestTemplate.from_text(text, "body", name="b.jinja")
    with pytest.raises(RowError, match=match):
        t.render({"q": "two words"})


@pytest.mark.parametrize("text", [
    "{{ ''.__class__.__mro__ }}",
    "{{ x.__class__.__base__.__subclasses__() }}",
    "{{ x.__init__.__globals__ }}",
    "{% set _ = tags.append(1) %}{{ tags }}",
])
def test_the_sandbox_refuses_escapes_and_mutation(text):
    t = prompt(text, "prompt")
    with pytest.raises(RowError) as e:
        t.render({"x": "a", "tags": [1]})
    assert "t.jinja line 1:" in str(e.value)
    assert "unsafe" in str(e.value) or "modify" in str(e.value)


def test_a_syntax_error_fails_at_load_with_its_line(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("Title: {{ title }}\n\nBody: {{ body }\n")
    with pytest.raises(TemplateError, match=r"^t.jinja line 3: unexpected '}'"):
        RequestTemplate.from_file(path)
    with pytest.raises(TemplateError, match=r"t.jinja line 1: .*endfor"):
        RequestTemplate.from_text("{% for x in y %}", name="t.jinja")
    with pytest.raises(TemplateError, match="no such template file"):
        RequestTemplate.from_file(tmp_path / "missing.jinja")


def test_from_file_names_the_template_by_its_file(tmp_path):
    path = tmp_path / "summary.jinja"
    path.write_text("Summarise {{ body }}\n", encoding="utf-8")
    t = RequestTemplate.from_file(path, prompt_as="prompt")
    assert t.name == "summary.jinja" and t.kind == "prompt"
    assert t.render({"body": "x"}) == {"prompt": "Summarise x"}  # jinja drops the final newline
    with pytest.raises(RowError, match="summary.jinja line 1: column 'body' is null"):
        t.render({"body": None})


def test_errors_from_filters_are_row_errors():
    t = prompt("{{ n + 1 }}\n{{ s | int }}")
    assert t.render({"n": 1, "s": "2"})["messages"][0]["content"] == "2\n2"
    with pytest.raises(RowError, match=r"t.jinja line 1: TypeError"):
        t.render({"n": "a", "s": "2"})
    with pytest.raises(RowError, match="column 'n' is null"):
        t.render({"n": None, "s": "2"})


def test_plain_templates_render_without_jinja_exactly_as_jinja_does():
    t = prompt("Q{{ a }}-{{ b }}\n{{ c }}{{ a }}", "prompt")
    assert t._plain is not None  # text and bare names only: the fast path
    assert prompt("{{ a | upper }}")._plain is None and prompt("{{ a.b }}")._plain is None
    assert prompt("{% if a %}{{ a }}{% endif %}")._plain is None and prompt("{{ range }}")._plain is None
    values = ["é\"x'<", 7, -1.5, 1e21, True, datetime.date(2026, 12, 3), decimal.Decimal("2.50"),
              datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc), ""]
    for value in values:
        row = {"a": value, "b": 0, "c": "z"}
        assert t.render(row) == {"prompt": t._template.render(row)}
    for row, match in [({"a": None, "b": 1, "c": ""}, "line 1: column 'a' is null"),
                       ({"a": 1, "c": ""}, "line 1: no column 'b'"),
                       ({"a": 1, "b": 1, "c": [1]}, "line 2: column 'c' is a list")]:
        with pytest.raises(RowError, match=match):  # the same messages as jinja's path
            t.render(row)
