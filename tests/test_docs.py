"""Every fenced block of README.md and docs/*.md is run or checked, so none goes stale.

The info string says what a block is and how it is checked:

Blocks run three at a time (each in its own session, on its own ports).

- ``python``: the block is written to a file and run (``python FILE``, cwd the repo root, the
  venv's ``bin`` first on PATH); it must exit 0, and print each ``# prints "TEXT"`` its comments
  promise (the README's first block promised 4 slots and printed 1 until session 34: only its exit
  was checked). A block that makes a LocalCluster must guard it
  with ``if __name__ == "__main__":``, as any file a user saves it to must.
- ``bash``, ``sh``: the block runs as one bash script with ``set -e`` (so every command line runs
  and must succeed), in its own session, which is killed at the end (commands started with ``&``
  too). ``console``: the lines starting with ``$ `` are the commands; the others are output.
  Two substitutions, so that the block runs here as written elsewhere: ``.venv/bin/`` is the bin
  directory of the interpreter running the tests, and the default scheduler port 8786 is a free one.
- ``... slow`` (too slow for CI) or ``... no-run`` (needs what this machine lacks: a Kubernetes API
  server, root to install packages; its reason in an HTML comment just above the block): each
  command is only checked: ``tangram-dask ARGS`` / ``dask tangram ARGS`` exit 0 with ``--help``
  appended (click rejects an unknown option before it shows the help), ``python SCRIPT ...`` exits
  0 with ``--help``, ``python -m pytest ARGS`` / ``pytest ARGS`` collect, ``make TARGET`` dry-runs
  (``make -n``) and each recipe line is checked the same way, ``pip install 'tangram-dask[X]'``
  names an extra of pyproject.toml, ``kubectl apply -f FILE`` names a manifest that parses.
  Python blocks so marked are compiled. A command no checker knows fails the test.
- ``yaml``: parses; a ``tangram:`` document is checked against the config schema.
- ``text``: not code (a file layout, an output format); it may hold no command line.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGS = {"python", "bash", "sh", "console", "text", "yaml"}
FLAGS = {"slow", "no-run"}
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
PARALLEL = 3  # blocks run at once
PRINTS = re.compile(r'#.*?\bprints "([^"]+)"')  # what a python block's comment says it prints
COMMAND_LIKE = re.compile(r"^\s*(\$ |(\.venv/bin/)?(python|pytest|tangram-dask|dask|make|pip|kubectl|apt-get) )")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    flags: frozenset[str]
    body: str
    before: str  # the text just above the fence

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            words = m.group(1).split()
            out.append(Block(path, text.count("\n", 0, m.start()) + 1, words[0] if words else "",
                             frozenset(words[1:]), m.group(2), text[:m.start()].rstrip()[-400:]))
    return out


BLOCKS = blocks()


def env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1"}


def commands(block: Block) -> list[str]:
    """The command lines of a shell block: ``\\`` continuations joined, comment-only lines dropped."""
    out, cur, going, joined = [], "", False, False
    for ln in block.body.splitlines():
        if block.lang == "console" and not going:
            if not ln.startswith("$ "):
                continue  # output
            ln = ln[2:]
        cur += ln.rstrip()
        going = cur.endswith("\\")
        if going:
            cur, joined = cur[:-1] + " ", True
            continue
        if cur.strip() and not cur.strip().startswith("#"):
            out.append(" ".join(cur.split()) if joined else cur.strip())  # the continuation's indent goes
        cur, joined = "", False
    return out


def local(cmd: str) -> str:
    return cmd.replace(".venv/bin/", f"{BIN}/")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(argv: list[str] | str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout, **kw)


# -- checks of commands that are not run ------------------------------------------------------------
def check_command(cmd: str, where: str) -> list[str]:
    """Check one command without running it; returns what was checked (raises on a problem)."""
    argv = shlex.split(cmd, comments=True)
    argv = [a for a in argv if a != "&"]
    prog = Path(argv[0]).name
    if prog == "tangram-dask" or (prog == "dask" and argv[1:2] == ["tangram"]):
        r = run([str(BIN / prog), *argv[1:], "--help"])
        assert r.returncode == 0, f"{where}: {cmd!r} --help exited {r.returncode}: {r.stdout}{r.stderr}"
        return [f"{' '.join(argv)} --help"]
    if prog.startswith("python") and argv[1:3] == ["-m", "pytest"] or prog == "pytest":
        args = argv[3:] if prog.startswith("python") else argv[1:]
        args = [a for a in args if a not in ("-q", "-x")]
        if not args:  # the whole suite: collecting it all would take as long as a test here; pytest is there
            r = run([sys.executable, "-m", "pytest", "--version"])
            assert r.returncode == 0, f"{where}: {cmd!r}: pytest is not installed: {r.stderr}"
            return ["pytest --version"]
        r = run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                timeout=300)
        assert r.returncode == 0, f"{where}: {cmd!r} does not collect: {r.stdout[-2000:]}{r.stderr[-2000:]}"
        return [f"pytest --collect-only {' '.join(args)}"]
    if prog.startswith("python") and len(argv) > 1 and argv[1].endswith(".py"):
        script = ROOT / argv[1]
        assert script.is_file(), f"{where}: {cmd!r}: no such script {argv[1]}"
        r = run([sys.executable, str(script), "--help"])
        assert r.returncode == 0, f"{where}: {argv[1]} --help exited {r.returncode}: {r.stderr[-2000:]}"
        return [f"{argv[1]} --help"]
    if prog.startswith("python") and argv[1:2] == ["-m"]:
        r = run([sys.executable, "-m", argv[2], "--help"])
        assert r.returncode == 0, f"{where}: python -m {argv[2]} --help exited {r.returncode}: {r.stderr[-2000:]}"
        return [f"python -m {argv[2]} --help"]
    if prog == "make":
        if shutil.which("make") is None:
            pytest.skip(f"{where}: make is not installed here, so {cmd!r} cannot be dry-run")
        r = run(["make", "-n", *argv[1:]])
        assert r.returncode == 0, f"{where}: make -n {' '.join(argv[1:])}: {r.stderr}"
        done = [f"make -n {' '.join(argv[1:])}"]
        for line in r.stdout.splitlines():
            if re.match(rf"^({re.escape(str(BIN))}/|\.venv/bin/)(tangram-dask|python -m pytest)", line):
                done += check_command(line, f"{where} (make {' '.join(argv[1:])})")
        return done
    if prog == "pip" and argv[1:2] == ["install"]:
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for spec in argv[2:]:
            m = re.fullmatch(r"tangram-dask\[([\w,-]+)\]", spec)
            assert m, f"{where}: {cmd!r}: only tangram-dask[extra] installs are documented"
            missing = set(m.group(1).split(",")) - set(extras)
            assert not missing, f"{where}: {cmd!r}: pyproject.toml has no extra {sorted(missing)}"
        return [f"pip install: extras in pyproject.toml ({cmd})"]
    if prog == "kubectl" and argv[1:2] == ["apply"] and "-f" in argv:
        manifest = ROOT / argv[argv.index("-f") + 1]
        assert manifest.is_file(), f"{where}: {cmd!r}: no such file"
        assert [d for d in yaml.safe_load_all(manifest.read_text()) if d], f"{where}: {manifest} is empty"
        return [f"kubectl apply: {manifest.relative_to(ROOT)} parses (tests/test_kubernetes_manifests.py checks it)"]
    raise AssertionError(f"{where}: no checker for {cmd!r}: make the block runnable, or add a checker here")


# -- the tests ----------------------------------------------------------------------------------------
def test_every_block_says_what_it_is():
    bad = [f"{b.id}: ```{b.lang} {' '.join(sorted(b.flags))}".rstrip() for b in BLOCKS
           if b.lang not in LANGS or not b.flags <= FLAGS]
    assert not bad, f"give every fenced block one of {sorted(LANGS)} and only flags {sorted(FLAGS)}: {bad}"
    unexplained = [b.id for b in BLOCKS if "no-run" in b.flags and not b.before.endswith("-->")]
    assert not unexplained, f"a no-run block needs its reason in an HTML comment just above it: {unexplained}"


def test_text_blocks_hold_no_commands():
    found = [(b.id, ln) for b in BLOCKS if b.lang == "text" for ln in b.body.splitlines() if COMMAND_LIKE.match(ln)]
    assert not found, f"a command in a text block is never run: make it bash or console: {found}"


RUN = [b for b in BLOCKS if b.lang in ("python", "bash", "sh", "console") and not b.flags & FLAGS]
CHECK = [b for b in BLOCKS if b.lang in ("python", "bash", "sh", "console") and b.flags & FLAGS]
YAML = [b for b in BLOCKS if b.lang == "yaml"]


def execute(block: Block) -> tuple[int, str, str]:
    """Run one block: (exit status, what ran, its output)."""
    with tempfile.TemporaryDirectory() as tmp:
        if block.lang == "python":
            script = Path(tmp) / "block.py"
            script.write_text(block.body)
            argv, what = [sys.executable, str(script)], block.body
        else:
            port = str(free_port())
            what = "set -e\n" + "\n".join(local(c).replace("8786", port) for c in commands(block)) + "\n"
            argv = ["bash", "-c", what]
        log = Path(tmp) / "output"
        with log.open("w") as f:  # a file, not a pipe: what runs on in the background must not hold the test
            proc = subprocess.Popen(argv, cwd=ROOT, env=env(), stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # what the block left running in the background
            except ProcessLookupError:
                pass
            proc.wait()
        out = log.read_text()
    return proc.returncode, what, out


@pytest.fixture(scope="module")
def ran(request):
    """The selected blocks run or checked, PARALLEL at a time (mostly they wait for processes)."""
    tests = {"test_block_runs": execute, "test_slow_and_no_run_blocks_parse": check_block}
    selected = [(tests[item.originalname], item.callspec.params["block"]) for item in request.session.items
                if getattr(item, "originalname", "") in tests and item.module.__name__ == __name__]
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        futures = {b.id: pool.submit(fn, b) for fn, b in selected}
        yield futures
        for f in futures.values():
            f.cancel()


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_block_runs(block: Block, ran):
    if block.lang != "python":
        assert commands(block), f"{block.id}: no command in a {block.lang} block"
    rc, what, out = ran[block.id].result()
    assert rc == 0, f"{block.id} exited {rc}:\n{what}\n{out[-6000:]}"
    promised = PRINTS.findall(block.body) if block.lang == "python" else []
    missing = [p for p in promised if p not in out]
    assert not missing, f"{block.id}: its comments promise it prints {missing}; it printed:\n{out[-6000:]}"


def check_block(block: Block) -> list[str]:
    if block.lang == "python":
        compile(block.body, block.id, "exec")
        return ["compiles"]
    cmds = commands(block)
    assert cmds, f"{block.id}: no command in a {block.lang} block"
    return [done for c in cmds for done in check_command(c, block.id)]


@pytest.mark.parametrize("block", CHECK, ids=[b.id for b in CHECK])
def test_slow_and_no_run_blocks_parse(block: Block, ran):
    assert ran[block.id].result()  # raises what the check raised


@pytest.mark.parametrize("block", YAML, ids=[b.id for b in YAML])
def test_yaml_blocks_parse_and_tangram_config_is_valid(block: Block):
    import dask

    from tangram_dask.config import validate

    for doc in yaml.safe_load_all(block.body):
        if isinstance(doc, dict) and "tangram" in doc:
            with dask.config.set(dask.config.merge(dask.config.config, doc)):
                validate()


def test_the_checker_is_not_vacuous():
    """A wrong subcommand, option, script or extra fails its check."""
    for cmd in ("tangram-dask bnch x y", "tangram-dask bench --no-such-option a b", "python benchmarks/nope.py",
                "pip install 'tangram-dask[nope]'", "frobnicate --now"):
        with pytest.raises(AssertionError):
            check_command(cmd, "test")
    assert commands(Block(ROOT, 1, "console", frozenset(), "$ a \\\n  b\noutput\n$ # note\n$ c\n", "")) == ["a b", "c"]
    rc, _, _ = execute(Block(ROOT, 1, "bash", frozenset(), "sleep 600 &\ntrue\nfalse\necho never\n", ""))
    assert rc == 1  # set -e: the failing line ends the block; the sleep in the background is killed
    rc, _, out = execute(Block(ROOT, 1, "python", frozenset(), "raise SystemExit('no')\n", ""))
    assert rc == 1 and "no" in out
