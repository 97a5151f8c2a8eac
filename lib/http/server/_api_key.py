"""Where the server's API key comes from: `--api-key`, `--api-key-file` or `TRILLM_API_KEY`.

A flag's value is on the command line, which every user of the machine reads in `ps`
(`/proc/PID/cmdline`); a file (mode 0600) or the environment (`/proc/PID/environ` is
readable by the same user and root only) keeps it to its owner.
"""

from __future__ import annotations

from collections.abc import Mapping

API_KEY_ENV = "TRILLM_API_KEY"


def read_api_key(key: str | None, key_file: str | None, environ: Mapping[str, str]) -> str | None:
    """The API key: `key` (the flag), else the first line of `key_file`, else
    `$TRILLM_API_KEY`; None when none is set (the server then asks for no key).

    Raises:
        ValueError: both the flag and the file are given, the file cannot be read, or the
            key it holds is empty.
    """
    if key is not None and key_file is not None:
        raise ValueError("give the API key once: --api-key or --api-key-file, not both")
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as exc:
            raise ValueError(f"--api-key-file {key_file}: {exc.strerror}") from None
        if not key:
            raise ValueError(f"--api-key-file {key_file} is empty: write the key on its first line")
        return key
    if key is not None:
        return key
    return environ.get(API_KEY_ENV) or None
