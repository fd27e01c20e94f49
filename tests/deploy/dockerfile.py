"""The Dockerfile read as Docker reads it: instructions by stage, and the build context that
.dockerignore leaves (what its COPY lines may take)."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]


def stages(path: Path = DOCKERFILE) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n(\s*#.*\n)*", " ", path.read_text())
    args: dict[str, str] = {}
    out: list[Stage] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, arg = line.partition(" ")
        op, arg = op.upper(), arg.strip()
        if op == "FROM":
            base, _, name = arg.partition(" AS ")
            out.append(Stage(base.strip(), name.strip()))
        elif out:
            out[-1].instructions.append((op, arg))
        elif op == "ARG":
            key, _, default = arg.partition("=")
            args[key] = default
    return args, out


def exec_form(arg: str) -> list[str]:
    value = json.loads(arg)
    assert isinstance(value, list)
    return [str(v) for v in value]


def ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or a directory above it wins."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.strip("/")
        if any(
            fnmatch.fnmatchcase(p, pat) or fnmatch.fnmatchcase(p, pat.replace("**/", ""))
            for p in prefixes
        ):
            result = not negate
    return result


def dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def build_context(dest: Path) -> Path:
    """Copy what `docker build .` would send (the repository less .dockerignore) to `dest`."""
    patterns = dockerignore()
    reincluded = [p[1:].strip("/") for p in patterns if p.startswith("!")]
    for top, dirs, files in os.walk(ROOT):
        here = Path(top).relative_to(ROOT).as_posix()
        here = "" if here == "." else here + "/"
        # skip a directory nothing under it can be re-included from (.git, .venv)
        dirs[:] = [
            d
            for d in dirs
            if not ignored(here + d, patterns)
            or any(r.startswith(here + d + "/") for r in reincluded)
        ]
        for name in files:
            rel = here + name
            if not ignored(rel, patterns):
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, target)
    return dest
