"""docs/deploy.md cannot drift: every `pdserve` command line in it (bash blocks and the
Kubernetes manifests' container commands) parses with pdserve's own CLI parsers, and every
environment variable it sets is one the env registry reads."""

from __future__ import annotations

import argparse
import os
import re
import shlex

import pytest
import yaml

from pdserve.core.config import ServerConfig, add_dataclass_args, dataclass_from_args
from pdserve.core.envs import REGISTRY
from pdserve.router.cli_args import build_router_parser, config_from_args

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "deploy.md")
KNOWN_ENV = {n for v in REGISTRY for n in (v.name, *v.aliases)}


class _Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # raise instead of exiting, so the test names the command line
        raise _Refused(message)


def _blocks(lang: str) -> list[str]:
    with open(DOC) as f:
        return re.findall(rf"```{lang}\n(.*?)```", f.read(), flags=re.S)


def bash_commands() -> list[list[str]]:
    out = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                out.append(shlex.split(line))
    return out


def manifest_commands() -> list[tuple[list[str], list[dict]]]:
    out = []
    for block in _blocks("yaml"):
        for doc in yaml.safe_load_all(block):
            if doc and doc.get("kind") == "Deployment":
                for c in doc["spec"]["template"]["spec"]["containers"]:
                    out.append((list(c["command"]) + list(c.get("args", [])), c.get("env", [])))
    return out


def check(argv: list[str]) -> None:
    """Parse `pdserve ...` as the CLI would and build its config (which validates it)."""
    assert argv[0] == "pdserve", argv
    cmd, rest = argv[1], argv[2:]
    if cmd == "serve":
        p = _Parser(prog="pdserve serve")
        add_dataclass_args(p, ServerConfig)
        dataclass_from_args(ServerConfig, p.parse_args(rest))
    elif cmd == "router":
        config_from_args(build_router_parser(_Parser(prog="pdserve router")).parse_args(rest))
    else:
        raise AssertionError(f"docs/deploy.md runs `pdserve {cmd}`, which this test does not check yet")


def test_the_doc_has_commands_to_check():
    assert len(bash_commands()) >= 6 and len(manifest_commands()) == 3


@pytest.mark.parametrize("argv", bash_commands(), ids=lambda a: " ".join(a)[:60])
def test_bash_command_parses(argv):
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        name = argv.pop(0).partition("=")[0]
        assert name in KNOWN_ENV, f"docs/deploy.md sets {name}, which pdserve does not read"
    try:
        check(argv)
    except _Refused as e:
        pytest.fail(f"docs/deploy.md: `{shlex.join(argv)}` is refused: {e}")


@pytest.mark.parametrize("argv,env", manifest_commands(), ids=lambda a: " ".join(a)[:60] if isinstance(a, list)
                         and a and isinstance(a[0], str) else "env")
def test_manifest_command_parses(argv, env):
    values = {e["name"]: "10.1.2.3" for e in env}
    for name in values:
        assert name == "POD_IP" or name in KNOWN_ENV, f"docs/deploy.md sets {name}, which pdserve does not read"
    argv = [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in argv]  # Kubernetes expands $(VAR)
    try:
        check(argv)
    except _Refused as e:
        pytest.fail(f"docs/deploy.md manifest: `{shlex.join(argv)}` is refused: {e}")
