"""The examples of the README and of the docs pages it leads to (PAGES) run, so they cannot rot.

- The README is a front page: at most 12 KB, and it links every page of PAGES.
- On each page, ```python and ```pycon blocks run in order in one namespace, as a reader pasting
  them would
  (pycon blocks through doctest, so the outputs they show are checked); none may warn from mgnn.
- A ```python block whose first line says ``mpiexec -n P`` is a complete script: it runs under
  real ``mpiexec -n P`` (with a timeout).
- Every ``python -m mgnn ...`` command of the pages parses with the CLI's own parser, the
  ``train`` synopsis names only real flags and the exact choices, ``make`` targets exist in the
  Makefile, pip extras exist in setup.cfg, and ``python path.py`` scripts exist.
"""
import argparse
import configparser
import doctest
import os
import re
import shlex
import shutil
import subprocess
import sys
import warnings

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
#: the README and the reference pages whose code is executed here
PAGES = ["README.md", "docs/user_guide.md", "docs/mpi.md", "docs/gpu.md", "docs/benchmarks.md"]
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")


def _text(page="README.md"):
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        return f.read()


def _all_text():
    return "\n".join(_text(p) for p in PAGES)


def fenced_blocks(text):
    """[(language, code, line number of the code's first line)] of the ``` blocks."""
    return [(m.group(1), m.group(2), text.count("\n", 0, m.start(2)) + 1)
            for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]


def _mpi_ranks(code):
    m = re.search(r"mpiexec -n (\d+)", code.splitlines()[0])
    return int(m.group(1)) if m else None


def shell_commands(text):
    """Commands of the indented (4-space) code blocks: continuations joined, comments dropped."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    out, cur = [], ""
    for line in text.splitlines():
        if not line.startswith("    ") and not cur:
            continue
        line = line.split(" #")[0].strip() if not line.strip().startswith("#") else ""
        cur += line
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        if cur:
            out.append(cur)
        cur = ""
    return out


def test_readme_is_a_front_page_with_examples():
    text = _text()
    assert len(text.encode()) <= 12 * 1024, f"README.md is {len(text.encode())} bytes"
    kinds = [lang for lang, _, _ in fenced_blocks(text)]
    assert kinds.count("pycon") >= 1 and kinds.count("python") >= 1
    guide = [lang for lang, _, _ in fenced_blocks(_text("docs/user_guide.md"))]
    assert guide.count("pycon") >= 1 and guide.count("python") >= 3
    assert "DESIGN.md" not in text and "docs/design.md" in text
    links = set(re.findall(r"\]\(([^)#]+)", text))
    for page in PAGES[1:] + ["docs/design.md"]:
        assert page in links, page
    for link in links:
        assert os.path.exists(os.path.join(REPO, link)), link
    for page in PAGES[1:]:  # relative links of the docs pages resolve
        for link in re.findall(r"\]\(([^)#:]+)", _text(page)):
            assert os.path.exists(os.path.join(REPO, "docs", link)), (page, link)


@pytest.mark.parametrize("page", PAGES)
def test_python_examples_run_in_order(page):
    ns = {"__name__": "__readme__"}
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for lang, code, line in fenced_blocks(_text(page)):
            if lang == "python" and _mpi_ranks(code) is None:
                exec(compile(code, f"{page}:{line}", "exec"), ns)
            elif lang == "pycon":
                test = doctest.DocTestParser().get_doctest(code, ns, f"{page}:{line}",
                                                           page, line - 1)
                out = []
                runner.run(test, out=out.append, clear_globs=False)
                assert not runner.failures, "".join(out)
                ns.update(test.globs)  # DocTest ran on a copy of the namespace
    # mgnn's own warnings (e.g. an MGRIT solve that did not converge) have no place in examples
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
            if w.category.__module__.split(".")[0] in ("mgnn", "builtins")
            and (os.sep + "mgnn" + os.sep in w.filename or page in w.filename)]
    assert not ours, ours


@pytest.mark.mpi
@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not installed")
def test_mpi_script_runs_under_mpiexec(tmp_path):
    scripts = [(code, line) for lang, code, line in fenced_blocks(_text("docs/mpi.md"))
               if lang == "python" and _mpi_ranks(code)]
    assert scripts, "docs/mpi.md has no MPI script"
    for code, line in scripts:
        path = tmp_path / "example.py"
        path.write_text(code)
        env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1",
                   OPENBLAS_NUM_THREADS="1")
        proc = subprocess.run([MPIEXEC, "-n", str(_mpi_ranks(code)), sys.executable, str(path)],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, f"docs/mpi.md:{line}\n{proc.stderr[-3000:]}"
        m = re.search(r"y\(1\) = ([0-9.]+)", proc.stdout)
        assert m and abs(float(m.group(1)) - (1 - 1 / 256) ** 256) < 1e-6, proc.stdout


def _cli():
    """The parser of ``python -m mgnn`` (built as mgnn.__main__.main builds it) and its
    subcommand parsers."""
    from mgnn import __main__ as cli
    parser = argparse.ArgumentParser(prog="python -m mgnn")
    sub = parser.add_subparsers(dest="command", required=True)
    cli._train_parser(sub)
    cli._bench_parser(sub)
    return parser, sub.choices


def _options(parser):
    """{option string: argparse action} of ``parser``."""
    return {s: a for a in parser._actions for s in a.option_strings}


def test_cli_commands_parse():
    parser = _cli()[0]
    commands = [c for c in shell_commands(_all_text()) if "python -m mgnn" in c]
    assert len(commands) >= 8
    checked = 0
    for cmd in commands:
        args = [a for a in shlex.split(cmd[cmd.index("python -m mgnn"):])[3:] if a != "..."]
        if any("|" in a or a.startswith("[") for a in args):
            continue  # the synopsis: test_train_synopsis_names_real_flags_and_choices
        try:
            parser.parse_args(args)
        except SystemExit as exc:
            pytest.fail(f"README command does not parse: {cmd!r}: {exc}")
        checked += 1
    assert checked >= 8


def test_train_synopsis_names_real_flags_and_choices():
    text = _text("docs/user_guide.md")
    start = text.index("python -m mgnn train --model")
    syn = text[start:text.index("python -m mgnn bench kernels", start)]
    opts = _options(_cli()[1]["train"])
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", syn))
    assert len(flags) > 25 and not flags - set(opts), sorted(flags - set(opts))
    for flag, listed in re.findall(r"(--[a-z-]+) (\w[\w.-]*(?:\|[\w.-]+)+)", syn):
        choices = opts[flag].choices or opts[flag].metavar.strip("{}").split(",")
        assert set(listed.split("|")) == set(choices), (flag, listed)


def test_make_targets_pip_extras_and_scripts_exist():
    with open(os.path.join(REPO, "Makefile")) as f:
        targets = set(re.findall(r"^([\w-]+):", f.read(), re.M))
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(REPO, "setup.cfg"))
    extras = set(cfg["options.extras_require"])
    text = _all_text()
    for cmd in shell_commands(text):
        words = [w for w in cmd.split() if "=" not in w]  # drop VAR=value prefixes
        if words[:1] == ["make"]:
            assert words[1] in targets, cmd
    for group in re.findall(r'pip install -e "\.\[([\w,]+)\]"', text):
        assert set(group.split(",")) <= extras, group
    for script in re.findall(r"python ([\w/]+\.py)", text):
        if script != "layer_parallel.py":  # the README's own MPI example
            assert os.path.isfile(os.path.join(REPO, script)), script
