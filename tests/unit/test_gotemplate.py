"""The Go template subset of ``dsec docker --format`` (dsec.cli.gotemplate): what docker's
users write, printed as Go prints it, and Go's messages for what does not parse or run."""

from __future__ import annotations

import pytest

from dsec.cli.gotemplate import GoStruct, TemplateError, go_json, go_str, parse, render

CONTAINER = {
    "Id": "sb-1",
    "State": {"Status": "running", "Running": True, "Pid": 0},
    "Config": {
        "Env": ["A=1", "B=<x&y>"],
        "Entrypoint": None,
        "Labels": {"team": "rl", "app": "web"},
        "User": "",
    },
    "NetworkSettings": {
        "Ports": {
            "8000/tcp": [{"HostIp": "127.0.0.1", "HostPort": "41234"}],
            "22/tcp": [{"HostIp": "0.0.0.0", "HostPort": "2222"}],
        }
    },
    "Sizes": [1, None, "x"],
    "Ratio": 1.5,
}


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{.State.Status}}", "running"),
        ("{{.State.Running}} {{.State.Pid}}", "true 0"),
        ("{{json .Config.Env}}", '["A=1","B=<x&y>"]'),  # docker's json: no HTML escaping
        ("{{.Config.Env | json}}", '["A=1","B=<x&y>"]'),
        ("{{json .Config.Entrypoint}}|{{.Config.Entrypoint}}", "null|<no value>"),
        ("{{.Config.Labels}}", "map[app:web team:rl]"),  # keys sorted, as fmt prints maps
        ("{{.Config.Env}}", "[A=1 B=<x&y>]"),
        ("{{.Sizes}} {{len .Sizes}}", "[1 <nil> x] 3"),
        ("{{.Ratio}}", "1.5"),
        ('{{(index (index .NetworkSettings.Ports "8000/tcp") 0).HostPort}}', "41234"),
        ('{{index .Config.Labels "team"}}|{{index .Config.Labels "none"}}', "rl|<no value>"),
        (
            "{{range $p, $b := .NetworkSettings.Ports}}{{$p}}={{(index $b 0).HostPort}};{{end}}",
            "22/tcp=2222;8000/tcp=41234;",
        ),
        ("{{range .Config.Env}}[{{.}}]{{end}}", "[A=1][B=<x&y>]"),
        ("{{range .Config.Entrypoint}}x{{else}}empty{{end}}", "empty"),
        ("{{range $i, $e := .Sizes}}{{if eq $i 1}}{{continue}}{{end}}{{$i}}{{end}}", "02"),
        ("{{range .Sizes}}{{break}}{{end}}done", "done"),
        ("{{if .State.Running}}up{{else}}down{{end}}", "up"),
        ("{{if .Config.User}}u{{else if .State.Running}}r{{else}}n{{end}}", "r"),
        ("{{if not .Config.User}}root{{end}}", "root"),
        ("{{with .Config}}{{.Labels.team}}{{end}}", "rl"),
        ("{{with .Config.User}}x{{else}}none{{end}}", "none"),
        ("{{$s := .State}}{{$s.Status}} {{$.Id}}", "running sb-1"),
        ('{{join .Config.Env ","}}', "A=1,B=<x&y>"),
        ('{{split "a,b" ","}}', "[a b]"),
        ("{{upper .State.Status}} {{title .State.Status}}", "RUNNING Running"),
        ('{{printf "%s:%d %v" .State.Status 3 .State.Running}}', "running:3 true"),
        ("{{println .Id}}x", "sb-1\nx"),
        ('{{print "a" 1 2 "b"}}', "a1 2b"),
        ('{{and .State.Running "yes"}} {{or .Config.User "none"}}', "yes none"),
        ('{{lt 1 2}} {{ge 1.5 2}} {{ne .Id "x"}}', "true false true"),
        ("a  {{- /* comment */ -}}  b {{- .Id -}} \n c", "absb-1c"),
        ("{{/* only a comment */}}", ""),
        ('{{"}}"}} {{`raw`}} {{42}} {{true}}', "}} raw 42 true"),
    ],
)
def test_renders_as_go_does(template: str, expected: str) -> None:
    assert render(template, CONTAINER) == expected


def test_values_print_as_fmt_prints_them() -> None:
    assert [go_str(v) for v in (1.0, 1e21, 1e-05, 0.0001, -2.5, 123456789.0, 1e20)] == [
        "1",
        "1e+21",
        "1e-05",
        "0.0001",
        "-2.5",
        "123456789",
        "100000000000000000000",
    ]
    assert go_str(None) == "<no value>"
    assert go_str({"a": [None, False]}) == "map[a:[<nil> false]]"
    assert go_json({"é": "<"}) == '{"é":"<"}'


def test_structs_with_methods() -> None:
    """What ``docker ps`` renders: fields, and methods called with the action's arguments."""
    row = GoStruct(
        "*formatter.ContainerContext",
        {"ID": "sb-1", "Names": "web"},
        {"Label": lambda key: {"team": "rl"}.get(key, "")},
    )
    assert render('{{.ID}} {{.Label "team"}}|{{.Label "x"}}', row) == "sb-1 rl|"
    assert render("{{json .}}", row) == '{"ID":"sb-1","Names":"web"}'
    assert render("{{.}}", row) == "{sb-1 web}"
    with pytest.raises(TemplateError) as e:
        render("{{.Nope}}", row)
    assert str(e.value) == (
        'template: :1:2: executing "" at <.Nope>: can\'t evaluate field Nope in type '
        "*formatter.ContainerContext"
    )


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{.Nope}}", 'template: :1:2: executing "" at <.Nope>: map has no entry for key "Nope"'),
        (
            "{{json .State.Nope}}",
            'template: :1:7: executing "" at <.State.Nope>: map has no entry for key "Nope"',
        ),
        (
            "x\n  {{.Q}}",
            'template: :2:4: executing "" at <.Q>: map has no entry for key "Q"',
        ),
        (
            "{{.State.Status.X}}",
            'template: :1:2: executing "" at <.State.Status.X>: can\'t evaluate field X in '
            "type string",
        ),
        (
            "{{.Config.Entrypoint.X}}",
            'template: :1:2: executing "" at <.Config.Entrypoint.X>: nil pointer evaluating '
            "interface {}.X",
        ),
        (
            "{{index .Sizes 9}}",
            'template: :1:2: executing "" at <index .Sizes 9>: error calling index: index out '
            "of range: 9",
        ),
        (
            "{{range .Ratio}}{{end}}",
            'template: :1:8: executing "" at <.Ratio>: range can\'t iterate over 1.5',
        ),
    ],
)
def test_execution_errors_are_gos(template: str, message: str) -> None:
    with pytest.raises(TemplateError) as e:
        render(template, CONTAINER)
    assert str(e.value) == message


def test_missing_keys_print_no_value_when_not_strict() -> None:
    assert parse("{{.Nope}}").execute(CONTAINER, strict=False) == "<no value>"


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{foo .}}", 'template: :1: function "foo" not defined'),
        ("{{.State", "template: :1: unclosed action"),
        ("{{if .X}}", "template: :1: unexpected EOF"),
        ("{{end}}", "template: :1: unexpected {{end}}"),
        ("{{else}}", "template: :1: unexpected {{else}}"),
        ("{{break}}", "template: :1: {{break}} outside {{range}}"),
        ('{{template "x"}}', "template: :1: {{template}} is not supported by dsec docker"),
        ("{{(.X}}", "template: :1: unclosed left paren"),
        ("{{}}", "template: :1: missing value for command"),
        ("{{/* open", "template: :1: unclosed comment"),
    ],
)
def test_parse_errors_are_gos(template: str, message: str) -> None:
    with pytest.raises(TemplateError) as e:
        parse(template)
    assert str(e.value) == message
