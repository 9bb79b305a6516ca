"""Output paths of one command: writable, never the same file twice, never an input (checked before any work)."""
from __future__ import annotations

import os
from pathlib import Path


def check_distinct(outputs: dict, inputs: dict | None = None) -> None:
    """Two outputs of one run may not name the same path, nor an output an input (``report R.json -o R.json``
    would replace the result with its report): refused naming both, before any work."""
    seen: dict[str, str] = {}
    for flag, path in outputs.items():
        if path is not None:
            key = os.path.realpath(path)
            if key in seen:
                raise ValueError(f"{flag} {path} and {seen[key]} name the same file: one would overwrite the other")
            seen[key] = f"{flag} {path}"
    for flag, paths in (inputs or {}).items():
        for path in paths if isinstance(paths, (list, tuple)) else [paths]:
            if path is not None and os.path.realpath(path) in seen:
                raise ValueError(f"{seen[os.path.realpath(path)]} is the input {flag} {path}: writing it would "
                                 "destroy the input")


def check_outputs(a) -> None:
    """Every subcommand's outputs against each other and its inputs."""
    outs = {f: getattr(a, d, None) for f, d in (("--json", "json"), ("--csv", "csv"), ("--parquet", "parquet"),
                                               ("--html", "html"), ("--dump", "dump"), ("--save-golden", "save_golden"),
                                               ("-o", "output"))}
    ins = {f: getattr(a, d, None) for f, d in (("--golden", "golden"), ("--tolerances", "tolerances"),
                                              ("--model", "model"), ("DUMP_DIR", "dump_dir"), ("RESULT", "results"),
                                              ("A.json", "a"), ("B.json", "b"))}
    check_distinct(outs, {k: v for k, v in ins.items() if isinstance(v, (Path, str, list, tuple))})


def check_output_paths(*paths: Path | None, allow_dir: bool = False) -> None:
    """Fail before any engine work if an output file cannot be written: its directory is created when
    missing; a path that is a directory (unless ``allow_dir``), or a directory that cannot be made or
    written, is named."""
    for path in paths:
        if path is None:
            continue
        is_dir = path.is_dir() or str(path).endswith("/")
        if is_dir and not allow_dir:
            raise ValueError(f"output {path} is a directory, not a file")
        folder = path if is_dir else path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"output {path}: cannot create directory {folder} ({e.strerror})") from None
        if not os.access(folder, os.W_OK):
            raise ValueError(f"output {path}: directory {folder} is not writable")


def check_dump_dir(path: Path, flag: str = "--dump") -> None:
    """A dump (or a saved golden) goes into a new or empty directory: steps of an older run must not mix in."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"{flag} {path}: exists and is not an empty directory")
    check_output_paths(path / "x")
