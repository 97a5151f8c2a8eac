"""`read_api_key`: the flag, a file or the environment; every refusal word for word."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trillm.cli import build_parser
from trillm.http.server._api_key import read_api_key


def test_the_flag_then_the_file_then_the_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n\n")
    env = {"TRILLM_API_KEY": "from-env"}
    assert read_api_key("from-flag", None, env) == "from-flag"
    assert read_api_key(None, str(key_file), env) == "from-file"
    assert read_api_key(None, None, env) == "from-env"
    assert read_api_key(None, None, {}) is None
    assert read_api_key(None, None, {"TRILLM_API_KEY": ""}) is None


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^give the API key once: --api-key or --api-key-file"):
        read_api_key("k", str(tmp_path / "key"), {})
    missing = tmp_path / "missing"
    message = f"--api-key-file {missing}: No such file or directory"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        read_api_key(None, str(missing), {})
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    message = f"--api-key-file {empty} is empty: write the key on its first line"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        read_api_key(None, str(empty), {})


def test_the_flags() -> None:
    args = build_parser().parse_args(["serve", "--api-key-file", "/k"])
    assert (args.api_key, args.api_key_file) == (None, "/k")
    args = build_parser().parse_args(["serve"])
    assert (args.max_prompts_per_request, args.request_body_timeout) == (1024, 30.0)
