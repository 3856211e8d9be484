"""The Dockerfile parser: every instruction, substitution, continuations, heredocs, and the
errors (with line numbers) for what it refuses."""

from __future__ import annotations

import pytest

from dsec.builds import (
    Arg,
    Cmd,
    Copy,
    Entrypoint,
    Env,
    Expose,
    FromImage,
    FromRegistry,
    Label,
    Run,
    User,
    Workdir,
    parse_dockerfile,
)
from dsec.errors import InvalidRequest


def steps(
    text: str, build_args: dict[str, str] | None = None, base_env: dict[str, str] | None = None
) -> list:  # type: ignore[type-arg]
    return parse_dockerfile(text).steps(build_args or {}, base_env or {})


def refused(text: str) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        steps(text)
    return e.value


# --- every instruction -------------------------------------------------------------------


def test_from_names_a_dsec_image_or_a_registry_reference() -> None:
    assert steps("FROM debian")[0] == FromImage(image="debian", source="FROM debian", line=1)
    assert isinstance(steps("FROM app:1.2")[0], FromImage)
    assert isinstance(steps("FROM k0123456789abcdef/app:1")[0], FromImage)
    for ref in ("docker.io/library/python:3.12", "ghcr.io/o/i:t", "python@sha256:" + "a" * 64):
        base = steps(f"FROM {ref}")[0]
        assert isinstance(base, FromRegistry) and base.ref == ref
    assert isinstance(steps("FROM --platform=linux/amd64 debian")[0], FromImage)


def test_run_shell_exec_and_flags() -> None:
    s = steps(
        "FROM debian\n"
        "RUN apt-get update && apt-get install -y curl\n"
        'RUN ["python3", "-c", "print(1)"]\n'
        "RUN --network=none make test\n"
        "RUN --mount=type=cache,target=/root/.cache/pip pip install numpy\n"
        "RUN [not json\n"
    )
    assert s[1] == Run(
        cmd="apt-get update && apt-get install -y curl",
        source="RUN apt-get update && apt-get install -y curl",
        line=2,
    )
    assert s[2].cmd == ["python3", "-c", "print(1)"] and s[2].network == "default"
    assert s[3].cmd == "make test" and s[3].network == "none"
    assert s[4].cmd == "pip install numpy" and s[4].network == "default"
    assert s[5].cmd == "[not json"  # not a JSON array: the shell form, as Docker does


def test_copy_and_add_with_flags_and_json_form() -> None:
    s = steps(
        "FROM debian\n"
        "COPY --chown=app:app --chmod=0755 src/ lib/*.py /app/\n"
        'COPY ["with space.txt", "/dst/"]\n'
        "ADD --link vendor.tar.gz /opt/\n"
    )
    assert s[1] == Copy(
        src=["src/", "lib/*.py"],
        dest="/app/",
        chown="app:app",
        chmod="0755",
        source="COPY --chown=app:app --chmod=0755 src/ lib/*.py /app/",
        line=2,
    )
    assert s[2].src == ["with space.txt"] and s[2].dest == "/dst/"
    assert s[3].add is True and s[3].src == ["vendor.tar.gz"]


def test_env_arg_workdir_user_label_expose_cmd_entrypoint_maintainer() -> None:
    s = steps(
        "FROM debian\n"
        "ENV A=1 B=\"two words\" C='$A'\n"
        "ENV LEGACY value with spaces\n"
        "ARG VERSION=1.0\n"
        "ARG EMPTY\n"
        "WORKDIR /srv/app\n"
        "USER app:staff\n"
        'LABEL org.example.name="demo app" version=$VERSION\n'
        "MAINTAINER someone@example.com\n"
        "EXPOSE 80 53/udp 8000-8010\n"
        'CMD ["serve", "--port", "80"]\n'
        "ENTRYPOINT /entry.sh $A\n"
    )
    assert s[1].vars == {"A": "1", "B": "two words", "C": "$A"}
    assert s[2].vars == {"LEGACY": "value with spaces"}
    assert s[3] == Arg(name="VERSION", default="1.0", source="ARG VERSION=1.0", line=4)
    assert s[4].name == "EMPTY" and s[4].default is None
    assert s[5] == Workdir(path="/srv/app", source="WORKDIR /srv/app", line=6)
    assert s[6] == User(user="app:staff", source="USER app:staff", line=7)
    assert s[7].labels == {"org.example.name": "demo app", "version": "1.0"}
    assert s[8] == Label(
        labels={"maintainer": "someone@example.com"},
        source="MAINTAINER someone@example.com",
        line=9,
    )
    assert s[9] == Expose(ports=["80/tcp", "53/udp", "8000-8010/tcp"], source=s[9].source, line=10)
    assert s[10] == Cmd(cmd=["serve", "--port", "80"], source=s[10].source, line=11)
    # shell forms keep $A for the shell (no substitution by the builder)
    assert s[11] == Entrypoint(
        entrypoint=["/bin/sh", "-c", "/entry.sh $A"], source=s[11].source, line=12
    )


def test_shell_changes_later_shell_forms() -> None:
    s = steps(
        'FROM debian\nSHELL ["/bin/bash", "-o", "pipefail", "-c"]\nRUN echo $BASH_VERSION\nCMD run it\n'
    )
    assert s[1].cmd == ["/bin/bash", "-o", "pipefail", "-c", "echo $BASH_VERSION"]
    assert s[2].cmd == ["/bin/bash", "-o", "pipefail", "-c", "run it"]


# --- substitution -----------------------------------------------------------------------------


def test_arg_values_from_build_args_defaults_and_substitution_in_later_lines() -> None:
    text = (
        "ARG BASE=debian\n"
        "FROM $BASE\n"
        "ARG BASE\n"
        "ARG PY=3.11\n"
        "ARG TAG\n"
        "ENV PYTHON=python${PY} TAGGED=${TAG:-none} SET=${PY:+yes} DASH=${TAG-unset}\n"
        "WORKDIR /opt/$BASE/${PY}\n"
        "COPY app-${PY}.tar /opt/\n"
        "RUN echo $PY\n"
    )
    s = steps(text)
    assert s[0] == FromImage(image="debian", source="FROM $BASE", line=2)
    assert s[1] == Arg(name="BASE", default="debian", source="ARG BASE", line=3)  # inherited
    assert s[4].vars == {"PYTHON": "python3.11", "TAGGED": "none", "SET": "yes", "DASH": "unset"}
    assert s[5].path == "/opt/debian/3.11"
    assert s[6].src == ["app-3.11.tar"]
    assert s[7].cmd == "echo $PY"  # RUN is the shell's business
    s = steps(text, {"BASE": "busybox", "PY": "3.12", "TAG": ""})
    assert s[0].image == "busybox"
    assert s[4].vars == {"PYTHON": "python3.12", "TAGGED": "none", "SET": "yes", "DASH": ""}
    assert s[5].path == "/opt/busybox/3.12"


def test_env_wins_over_arg_and_sees_the_base_env_and_values_before_its_line() -> None:
    s = steps(
        "FROM python\n"
        "ARG X=from-arg\n"
        "ENV X=from-env\n"
        "WORKDIR /$X\n"
        "ENV A=1\n"
        "ENV A=2 B=$A\n"
        "ENV P=$PATH:/opt/bin\n",
        base_env={"PATH": "/usr/local/bin:/usr/bin"},
    )
    assert s[3].path == "/from-env"
    assert s[5].vars == {"A": "2", "B": "1"}  # B sees A as it was before the instruction
    assert s[6].vars == {"P": "/usr/local/bin:/usr/bin:/opt/bin"}


def test_quotes_and_escapes() -> None:
    s = steps('FROM debian\nENV A=x\nENV S=\'$A\' D="$A" E=\\$A Q="a \\"q\\" b" SP=a\\ b\n')
    assert s[2].vars == {"S": "$A", "D": "x", "E": "$A", "Q": 'a "q" b', "SP": "a b"}


# --- continuations, comments, directives, heredocs --------------------------------------------


def test_line_continuations_and_comments() -> None:
    s = steps(
        "# a comment\n"
        "FROM debian\n"
        "\n"
        "RUN apt-get update \\\n"
        "    # a comment inside the continuation is dropped\n"
        "    && apt-get install -y \\\n"
        "       git   \n"
        "RUN echo done\n"
    )
    assert s[1].cmd == "apt-get update     && apt-get install -y        git"
    assert s[1].line == 4
    assert s[2].line == 8


def test_escape_directive_and_ignored_syntax_directive() -> None:
    s = steps(
        "# syntax=docker/dockerfile:1\n# escape=`\nFROM debian\nRUN echo a `\n  b\nRUN echo C:\\dir\n"
    )
    assert s[1].cmd == "echo a   b"
    assert s[2].cmd == "echo C:\\dir"


def test_run_heredocs() -> None:
    s = steps(
        "FROM debian\n"
        "RUN <<EOF\n"
        "set -e\n"
        "echo one\n"
        "EOF\n"
        "RUN cat > /etc/app.conf <<-END\n"
        "\tkey=$VALUE\n"
        "\tEND\n"
        "RUN <<EOF\n"
        "#!/usr/bin/env python3\n"
        "print('hi')\n"
        "EOF\n"
    )
    assert s[1].cmd == ["/bin/sh", "-c", "set -e\necho one\n"]
    # a command with a heredoc: the shell reads the heredoc itself (tabs, expansion)
    assert s[2].cmd == ["/bin/sh", "-c", "cat > /etc/app.conf <<-END\n\tkey=$VALUE\n\tEND\n"]
    assert s[3].cmd[:2] == ["/bin/sh", "-c"] and "print('hi')" in s[3].cmd[2]
    assert "#!/usr/bin/env python3" in s[3].cmd[2] and 'chmod +x "$f"' in s[3].cmd[2]


def test_copy_heredoc_is_an_inline_file_expanded_unless_quoted() -> None:
    s = steps(
        "FROM debian\nARG NAME=world\n"
        "COPY <<EOF /etc/greeting\nhello $NAME\nEOF\n"
        "COPY <<'EOF' /etc/raw\nhello $NAME\nEOF\n"
    )
    assert s[2].inline[0].name == "EOF" and s[2].inline[0].content == "hello world\n"
    assert s[2].src == [] and s[2].dest == "/etc/greeting"
    assert s[3].inline[0].content == "hello $NAME\n"


# --- refusals name the line and the instruction ------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "instruction", "words"),
    [
        ("FROM debian AS build\nRUN make\n", 1, "FROM", "multi-stage"),
        ("FROM debian\nRUN make\nFROM busybox\n", 3, "FROM", "multi-stage"),
        ("FROM debian\n\nCOPY --from=build /out /out\n", 3, "COPY", "--from"),
        ("FROM debian\nHEALTHCHECK CMD curl -f http://localhost/\n", 2, "HEALTHCHECK", "health"),
        ("FROM debian\nONBUILD RUN make\n", 2, "ONBUILD", "ONBUILD"),
        ("FROM debian\nVOLUME /data\n", 2, "VOLUME", "volumes"),
        ("FROM debian\nSTOPSIGNAL SIGTERM\n", 2, "STOPSIGNAL", "STOPSIGNAL"),
        ("FROM debian\nFROBNICATE x\n", 2, "FROBNICATE", "unknown"),
        ("FROM debian\nADD https://example.com/x.tgz /x\n", 2, "ADD", "remote"),
        ("FROM debian\nRUN --mount=type=bind,source=a,target=/a make\n", 2, "RUN", "type=bind"),
        ("FROM debian\nRUN --network=host make\n", 2, "RUN", "--network=host"),
        ("FROM scratch\n", 1, "FROM", "scratch"),
        ("FROM debian\nRUN <<EOF\necho never ends\n", 2, "RUN", "not terminated"),
        ("FROM debian\nENV 1BAD=x\n", 2, "ENV", "invalid environment variable name"),
        ("FROM debian\nCOPY onlyone\n", 2, "COPY", "source and a destination"),
        ("FROM debian\nUSER a b\n", 2, "USER", "exactly one"),
        ('FROM debian\nENV A="unterminated\n', 2, "ENV", "unterminated"),
        ("FROM debian\nWORKDIR ${A:?must be set}\n", 2, "WORKDIR", "must be set"),
        ("FROM --platform=linux/arm64 debian\n", 1, "FROM", "linux/amd64 only"),
        ("FROM debian\nEXPOSE eighty\n", 2, "EXPOSE", "invalid port"),
    ],
)
def test_refused_with_line_and_instruction(
    text: str, line: int, instruction: str, words: str
) -> None:
    err = refused(text)
    assert err.details["line"] == line and err.details["instruction"] == instruction
    assert f"Dockerfile line {line}: {instruction}" in err.message
    assert words in err.message


def test_no_from_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="no FROM"):
        steps("RUN make\n")


def test_used_args_and_the_source_text_of_an_instruction() -> None:
    df = parse_dockerfile("ARG A\nFROM debian\nARG B=1 C\nRUN   echo   hi\n")
    assert df.used_args() == {"A", "B", "C"}
    assert df.instructions[-1].source == "RUN echo   hi"
    assert isinstance(steps("FROM debian\nENV K=v\n")[1], Env)
