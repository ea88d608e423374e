"""docs/flags.md is generated from the flag table `dsaserve serve` parses, and every flag says what
it does (scripts/flags_doc.py)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from dsaserve.args import ServerArgs, add_server_args
from dsaserve.flags import SECTIONS

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import flags_doc  # noqa: E402


def parser() -> argparse.ArgumentParser:
    built = argparse.ArgumentParser(prog="dsaserve serve")
    add_server_args(built)
    return built


def test_docs_flags_md_is_current():
    assert flags_doc.DOC.read_text() == flags_doc.render(), (
        "docs/flags.md is stale: python scripts/flags_doc.py --write"
    )


def test_every_flag_has_a_help_and_a_row():
    actions = [a for a in parser()._actions if not isinstance(a, argparse._HelpAction)]
    assert actions and all(a.help and "(default: " in a.help for a in actions)
    doc = flags_doc.DOC.read_text()
    for action in actions:
        for name in action.option_strings:
            assert f"`{name}`" in doc, f"docs/flags.md lacks {name}"
    flags = [flag for flags in SECTIONS.values() for flag in flags]
    assert all(flag.help.strip() for flag in flags)


def test_every_server_arg_is_a_flag():
    dests = {a.dest for a in parser()._actions}
    fields = {f.name for f in dataclasses.fields(ServerArgs)} - {"model_id"}  # not a flag
    assert fields - dests == set()


def test_help_shows_meaning_and_default():
    text = parser().format_help()
    assert "Memory and scheduling:" in text and "0.85 GPU / 0.05 CPU" in text
    assert "accepted for SGLang command lines" in text  # which flags are real
