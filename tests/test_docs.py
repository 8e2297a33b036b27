"""Every `voodoo` command line in README.md, skills/*.md and configs/*.sh must parse.

A command is taken from fenced ``bash``/``sh`` blocks of the Markdown files and from the whole of
the shell launchers. Line continuations, quotes spanning lines, comments and shell variables are
resolved the way bash would resolve them here: assignments made earlier in the same file
(``SIZE=${SIZE:-65}`` gives 65) are substituted, anything else (``$(...)``, loop variables,
caller-set variables) becomes a placeholder word. Each command then goes through the real Typer
app's Click command exactly as `voodoo` would see it (`cli.argv.normalize` for flag spellings and
space-separated lists) via ``make_context``, which parses without invoking. `train` and `tp` lines
also build their TrainConfig, so a value the trainer refuses fails here, without loading a model.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
import typer

from voodoo_quant.cli.app import app
from voodoo_quant.cli.argv import declared_flags, normalize
from voodoo_quant.cli.tp import parse_train_flags
from voodoo_quant.cli.train import build_config
from voodoo_quant.core.errors import VoodooError

try:  # newer typer parses with a vendored copy of click whose errors are not click's own
    from typer._click.exceptions import UsageError as _TyperUsageError
except ImportError:  # pragma: no cover - typer on plain click
    _TyperUsageError = click.UsageError
USAGE_ERRORS = (click.UsageError, _TyperUsageError)
EXITS = (click.exceptions.Exit, typer.Exit)  # --help

ROOT = Path(__file__).resolve().parent.parent
SKILLS = ("install", "data", "train", "export", "eval")
LAUNCHERS = ("cpu_smollm2_demo.sh", "qwen35_08b_voodoo45.sh", "qwen38_27b_voodoo30_tp4.sh", "single_gpu_template.sh")
FENCE_LANGS = {"bash", "sh", "shell"}
SHELL_KEYWORDS = {"then", "do", "else", "if", "elif", "while", "until", "!", "time", "exec", "{"}
SEPARATORS = {"||", "&&", ";", "|", "&", "(", ")", ";;"}
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"


@dataclass
class Command:
    path: str
    line: int
    argv: list[str]  # after the `voodoo` executable

    def where(self) -> str:
        return f"{self.path}:{self.line}"


# -- shell text → logical lines ----------------------------------------------------------------

def _balanced(text: str) -> bool:
    """Quotes closed and parentheses (outside quotes) matched: a multi-line `A=(...)` goes on."""
    try:
        lex = shlex.shlex(text, posix=True, punctuation_chars=";&|()")
        lex.whitespace_split = True
        tokens = list(lex)
    except ValueError:  # "No closing quotation" / "No escaped character"
        return False
    punct = [t for t in tokens if t and set(t) <= set(";&|()")]
    return sum(t.count("(") for t in punct) <= sum(t.count(")") for t in punct)


def logical_lines(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Join backslash continuations and quotes that span lines; keep the first line's number."""
    out: list[tuple[int, str]] = []
    buf, start = "", 0
    for no, raw in lines:
        if not buf:
            start = no
        s = raw.rstrip()
        if s.endswith("\\") and not s.lstrip().startswith("#"):
            buf += s[:-1]  # bash drops backslash-newline
            continue
        buf += raw
        if _balanced(buf):
            out.append((start, buf))
            buf = ""
        else:
            buf += "\n"  # a quoted string goes on, newline included
    if buf:
        out.append((start, buf))
    return out


def shell_blocks(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every line a shell would run: the whole .sh, fenced blocks of .md."""
    text = path.read_text(encoding="utf-8").splitlines()
    if path.suffix == ".sh":
        return list(enumerate(text, 1))
    out: list[tuple[int, str]] = []
    fence, shell = False, False
    for no, line in enumerate(text, 1):
        s = line.strip()
        if s.startswith("```"):
            fence, shell = (False, False) if fence else (True, s[3:].strip().lower() in FENCE_LANGS)
            continue
        if shell:
            out.append((no, line))
    return out


# -- variable substitution ---------------------------------------------------------------------

def _placeholder(name: str) -> str:
    return f"placeholder_{name.lower()}"


def _matching(text: str, i: int, open_: str, close: str) -> int:
    """Index of the `close` matching the `open_` at text[i] (nesting counted)."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_:
            depth += 1
        elif text[j] == close:
            depth -= 1
            if depth == 0:
                return j
    return len(text) - 1


def _quote_for(value: str, in_double: bool) -> str:
    return re.sub(r'(["\\$`])', r"\\\1", value) if in_double else value


def _expand_braced(body: str, env: dict[str, str]) -> tuple[str, bool]:
    """(value, is_array) of ``${body}``: NAME, NAME[@], NAME:-word, NAME:=word, NAME:+word."""
    m = re.fullmatch(rf"({_NAME})(\[[@*]\])?(?:(:?[-=+])(.*))?", body, re.S)
    if m is None:
        return _placeholder("expr"), False
    name, index, op, word = m.groups()
    if index:
        return env.get(name, "").strip(), True  # array: kept as shell text, split by the later shlex
    val = env.get(name)
    if op is None:
        return (val if val is not None else _placeholder(name)), False
    set_ = val is not None and (val != "" or not op.startswith(":"))
    if op.endswith("+"):
        return (_words(word, env) if set_ else ""), False
    if set_:
        return val, False
    expanded = _words(word, env)
    if op.endswith("="):
        env[name] = expanded
    return expanded, False


def _words(text: str, env: dict[str, str]) -> str:
    """`text` expanded and unquoted, its words joined by one space (assignment semantics)."""
    return " ".join(_tokens(substitute(text, env)))


def substitute(text: str, env: dict[str, str]) -> str:
    """Expand $NAME, ${NAME...}, $(...) outside single quotes, as text for a later shlex split."""
    out: list[str] = []
    i, in_single, in_double = 0, False, False
    while i < len(text):
        c = text[i]
        if c == "\\" and not in_single and i + 1 < len(text):
            out.append(text[i:i + 2])
            i += 2
            continue
        if c == "'" and not in_double:
            in_single = not in_single
        elif c == '"' and not in_single:
            in_double = not in_double
        elif c == "$" and not in_single and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "(":
                out.append(_placeholder("cmd"))
                i = _matching(text, i + 1, "(", ")") + 1
                continue
            if nxt == "{":
                j = _matching(text, i + 1, "{", "}")
                val, is_array = _expand_braced(text[i + 2:j], env)
                i = j + 1
                if is_array and in_double:
                    if not val and out and out[-1] == '"' and text[i:i + 1] == '"':
                        out.pop()  # "${EMPTY[@]}" is no word at all
                        in_double = False
                        i += 1
                    else:
                        out.append(f'"{val.strip()}"')  # close the quotes so the elements split
                elif is_array:
                    out.append(val)
                else:
                    out.append(_quote_for(val, in_double))
                continue
            m = re.match(_NAME, text[i + 1:])
            if m:
                name = m.group(0)
                out.append(_quote_for(env.get(name, _placeholder(name)), in_double))
                i += 1 + len(name)
                continue
            if nxt.isdigit() or nxt in "@*#?$!":
                out.append(_placeholder("arg"))
                i += 2
                continue
        out.append(c)
        i += 1
    return "".join(out)


# -- command extraction ------------------------------------------------------------------------

def _tokens(text: str) -> list[str]:
    lex = shlex.shlex(text, posix=True, punctuation_chars=";&|()")
    lex.whitespace_split = True
    return list(lex)


def _segments(tokens: list[str]) -> list[list[str]]:
    segs, cur = [], []
    for t in tokens:
        if t in SEPARATORS:
            segs.append(cur)
            cur = []
        else:
            cur.append(t)
    segs.append(cur)
    return [s for s in segs if s]


_ASSIGN = re.compile(rf"^(?:export\s+|readonly\s+|local\s+)?({_NAME})(\+?=)(.*)$", re.S)


def _without_cmds(text: str) -> str:
    """`text` with every ``$(...)`` replaced by one word (it may hold spaces and parentheses)."""
    while (i := text.find("$(")) >= 0:
        text = text[:i] + _placeholder("cmd") + text[_matching(text, i + 1, "(", ")") + 1:]
    return text


def _record_assignment(text: str, env: dict[str, str]) -> bool:
    """Track `NAME=value` / `NAME=(a b)` / `NAME+=(a b)`; True if `text` is one."""
    m = _ASSIGN.match(text)
    if not m:
        return False
    name, op, rhs = m.groups()
    if rhs.startswith("("):
        val = substitute(rhs[1:_matching(rhs, 0, "(", ")")], env)  # array: shell text, split when used
        env[name] = f"{env.get(name, '')} {val}".strip() if op == "+=" else val
        return True
    if not _balanced(rhs) or len(_tokens(_without_cmds(rhs))) > 1:
        return False  # `NAME=v command ...` (an environment prefix) or several assignments
    env[name] = _words(rhs, env)
    return True


def extract(path: Path, rel: str | None = None) -> list[Command]:
    env = {"V": "voodoo"}  # `$V ...` is voodoo unless the file says where
    cmds: list[Command] = []
    for line_no, text in logical_lines(shell_blocks(path)):
        stripped = text.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if _record_assignment(stripped, env):
            continue
        try:
            tokens = _tokens(substitute(text, env))
        except ValueError as e:
            raise AssertionError(f"{rel or path}:{line_no}: cannot tokenize: {e}") from None
        for seg in _segments(tokens):
            while seg and (seg[0] in SHELL_KEYWORDS or re.match(rf"{_NAME}=", seg[0])):
                seg = seg[1:]
            if seg and os.path.basename(seg[0]) == "voodoo":
                cmds.append(Command(rel or str(path), line_no, seg[1:]))
    return cmds


# -- parsing through the real CLI --------------------------------------------------------------

_GROUP = typer.main.get_command(app)


def check(cmd: Command) -> str | None:
    """None if `voodoo <argv>` parses (and validates for train/tp), else the reason."""
    args = list(cmd.argv)
    root_flags = set(declared_flags(_GROUP)) | {"--help"}
    while args and args[0].startswith("-"):
        if args[0] not in root_flags:
            return f"unknown option {args[0]!r} before the command"
        args.pop(0)
    if not args:
        return "no command"
    name, rest = args[0], args[1:]
    sub = _GROUP.commands.get(name)
    if sub is None:
        return f"no such command {name!r} (known: {', '.join(sorted(_GROUP.commands))})"
    try:
        ctx = sub.make_context(name, normalize(rest, declared_flags(sub)))
        if name == "train":
            build_config(**ctx.params)
        elif name == "tp":
            cfg = parse_train_flags(list(ctx.args))
            if cfg.tensor_parallel not in (1, ctx.params["nproc"]):
                return (f"the train flags' --tensor_parallel {cfg.tensor_parallel} disagrees with "
                        f"`voodoo tp --tensor_parallel {ctx.params['nproc']}`")
    except EXITS as e:  # --help
        code = getattr(e, "exit_code", 0)
        return None if code == 0 else f"exit {code}"
    except USAGE_ERRORS as e:
        return e.format_message()
    except VoodooError as e:
        return str(e)
    return None


def failures(cmds: list[Command]) -> list[str]:
    return [f"{c.where()}: voodoo {shlex.join(c.argv)[:160]} -> {why}" for c in cmds if (why := check(c))]


# -- the tests ---------------------------------------------------------------------------------

def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "skills").glob("*.md")), *sorted((ROOT / "configs").glob("*.sh"))]


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documented_command_parses(path):
    rel = str(path.relative_to(ROOT))
    cmds = extract(path, rel)
    assert cmds, f"{rel}: no `voodoo` command line found (extraction broken or the file documents none)"
    bad = failures(cmds)
    assert not bad, "documented commands that do not parse:\n" + "\n".join(bad)


def test_required_docs_exist_and_cover_every_command():
    for s in SKILLS:
        assert (ROOT / "skills" / f"{s}.md").is_file(), f"skills/{s}.md missing"
    for c in LAUNCHERS:
        assert (ROOT / "configs" / c).is_file(), f"configs/{c} missing"
    assert (ROOT / "AGENTS.md").is_file()
    seen = {c.argv[0] for p in doc_files() for c in extract(p) if c.argv}
    missing = set(_GROUP.commands) - seen
    assert not missing, f"no documented example of: {', '.join(sorted(missing))}"


def test_reference_recipe_launcher_is_the_spec_recipe():
    """The TP-4 launcher runs the SPEC's reference recipe: every one of its flags, same values."""
    (tp,) = [c for c in extract(ROOT / "configs" / "qwen38_27b_voodoo30_tp4.sh") if c.argv[0] == "tp"]
    cfg = parse_train_flags(tp.argv[tp.argv.index("--") + 1:])
    assert tp.argv[1:3] == ["--nproc", "4"]
    assert (cfg.compression_ratio, cfg.budget_reduction, cfg.seq_len, cfg.batch_size, cfg.max_steps) == (0.30, 0.03, 8192, 1, 100)
    assert (cfg.lr, cfg.size_weight, cfg.size_tolerance, cfg.tensor_parallel) == (0.5, 100.0, 0.02, 4)
    assert cfg.candidate_types == ("Q8_0", "Q5_K", "IQ3_S", "IQ2_S", "IQ2_XXS", "IQ1_S")
    assert cfg.attention_candidates == ("Q5_K", "IQ3_S", "IQ2_S", "IQ2_XXS")
    assert cfg.non_attention_candidates == ("IQ4_XS", "IQ3_S", "IQ2_S", "IQ2_XXS", "IQ1_S")
    assert [(u.pattern, u.levels) for u in cfg.upgrades] == [(r"mlp\.(gate|up|down)_proj$", 1), ("linear_attn|self_attn", -1)]
    assert cfg.lazy and cfg.gradient_checkpointing and cfg.no_compile and cfg.partial_save_interval == 1
    assert (cfg.text_model_class, cfg.teacher_quant, cfg.device, cfg.dtype) == ("qwen3_5_text", "Q8_0", "cuda:0", "bfloat16")
    assert cfg.output_name == "Qwen3.8-27B-Voodoo30.pt" and cfg.data_name == "train_tokens.pt"
    assert (cfg.model, cfg.base_checkpoint, cfg.teacher_checkpoint, cfg.imatrix, cfg.data_dir, cfg.output_dir) == (
        "./Qwen3.8-27B", "checkpoints/Qwen3.8-27B/qwen38_27b_lm_base.pt",
        "checkpoints/Qwen3.8-27B/qwen38_27b_lm_teacher_q8_0.pt", "imatrix.gguf", "data/qwen38-longctx",
        "checkpoints/Qwen3.8-27B/Voodoo30")


@pytest.mark.parametrize("script", sorted((ROOT / "configs").glob("*.sh")), ids=lambda p: p.name)
def test_launchers_are_bash_clean_and_executable(script):
    bash = shutil.which("bash")
    assert bash, "bash not found"
    r = subprocess.run([bash, "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, f"bash -n {script.name}: {r.stderr.strip()}"
    assert os.access(script, os.X_OK), f"{script.name} is not executable (chmod +x)"


# -- the checker itself can fail ---------------------------------------------------------------

BROKEN = """\
V=.venv/bin/voodoo
SIZE=${SIZE:-45}
$V train --model m --compression_ratio 0.$SIZE \\
    --seq_length 512
[ -f x ] || $V export --model m --output_dir out
$V train --model m --compression_ratio 0.$SIZE --candidate_types Q8_0 Q9_9
$V train --model m --compression_ratio 0.$SIZE --tensor_upgrades '[{"pattern": "(",
    "levels": 1}]'
$V frobnicate --model m
$V tp --tensor_parallel 2 -- --model m --compression_ratio 0.3 --tensor_parallel 4
$V train --model "$MODEL" --compression_ratio "0.$SIZE" --candidate_types Q8_0 Q5_K IQ3_S --dry_run
"""


def test_checker_reports_each_broken_line(tmp_path):
    f = tmp_path / "broken.sh"
    f.write_text(BROKEN)
    cmds = extract(f, "broken.sh")
    assert [c.line for c in cmds] == [3, 5, 6, 7, 9, 10, 11]
    reasons = {c.line: check(c) for c in cmds}
    assert "--seq_length" in reasons[3]
    assert "--assignment" in reasons[5]  # missing required option
    assert "Q9_9" in reasons[6]  # TrainConfig validation
    assert "--tensor_upgrades" in reasons[7]  # invalid regex, in a quote spanning two lines
    assert "frobnicate" in reasons[9]
    assert "disagrees with `voodoo tp --tensor_parallel 2`" in reasons[10]
    assert reasons[11] is None  # variables substituted, unquoted list spread over words
    assert cmds[-1].argv[cmds[-1].argv.index("--model") + 1] == "placeholder_model"
    assert all(r.startswith("broken.sh:") for r in failures(cmds))


def test_markdown_only_fenced_shell_blocks(tmp_path):
    f = tmp_path / "doc.md"
    f.write_text("Run `voodoo train --bogus` (prose is not parsed).\n\n```python\nvoodoo = 1\n```\n\n"
                 "```bash\nvoodoo doctor --json   # a comment\nvoodoo doctor --jsn\n```\n")
    cmds = extract(f, "doc.md")
    assert [(c.line, c.argv) for c in cmds] == [(8, ["doctor", "--json"]), (9, ["doctor", "--jsn"])]
    assert check(cmds[0]) is None and "--jsn" in check(cmds[1])


# -- the product speaks of itself --------------------------------------------------------------
# The history lives in docs/lab/ by date and commit; the product (code, tests, docs, launchers)
# cites neither the tracker's issue numbers nor the lab's old "stop N" entries, and the facts it
# relies on are stated in docs/facts.md, not in a file outside the repository.

HISTORY_REF = re.compile(r"\b(?:stop|issue)s?[ \t_#-]*\d", re.IGNORECASE)
OUTSIDE_FACTS = re.compile(r"FACTS\.md")
PRODUCT = ("README.md", "WHITEPAPER.md", "AGENTS.md", "Makefile", "pyproject.toml",
           "voodoo_quant", "tests", "configs", "skills", "bench", "scripts", "docs")
TEXT_SUFFIXES = {"", ".md", ".py", ".sh", ".toml", ".txt", ".cfg", ".json", ".yaml", ".yml", ".pin"}
MD_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")


def product_files(root: Path = ROOT) -> list[Path]:
    files: list[Path] = []
    for entry in PRODUCT:
        p = root / entry
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files += [f for f in sorted(p.rglob("*")) if f.is_file() and f.suffix in TEXT_SUFFIXES
                      and "__pycache__" not in f.parts and not f.name.startswith(".")]
    return [f for f in files if f.resolve() != Path(__file__).resolve()]


def citations(files: list[Path], pattern: re.Pattern, root: Path = ROOT) -> list[str]:
    """`path:line: text` of every match of `pattern` in `files`."""
    out = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for no, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                out.append(f"{f.relative_to(root)}:{no}: {line.strip()[:120]}")
    return out


def test_the_product_cites_no_issue_or_stop_numbers():
    bad = citations(product_files(), HISTORY_REF)
    assert not bad, ("issue/stop numbers in the product (speak of dates and commits in docs/lab/, "
                     "of the thing itself elsewhere):\n" + "\n".join(bad))


def test_the_product_cites_no_facts_file_outside_it():
    bad = citations(product_files(), OUTSIDE_FACTS)
    assert not bad, "FACTS.md is not part of the project; state the fact in docs/facts.md:\n" + "\n".join(bad)


def broken_links(docs: list[Path], root: Path = ROOT) -> list[str]:
    """`path: target` of every relative Markdown link whose target does not exist."""
    return [f"{d.relative_to(root)}: {target}" for d in docs
            for target in MD_LINK.findall(d.read_text(encoding="utf-8"))
            if "://" not in target and not (d.parent / target).exists()]


def test_markdown_links_resolve():
    docs = [ROOT / "README.md", ROOT / "WHITEPAPER.md", ROOT / "AGENTS.md",
            *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "skills").glob("*.md"))]
    bad = broken_links(docs)
    assert not bad, "links to files that do not exist:\n" + "\n".join(bad)


def test_citation_checks_find_what_they_must(tmp_path):
    (tmp_path / "skills").mkdir()
    (tmp_path / "skills" / "a.md").write_text(
        "As Stop 36 found\nsee issue-15 and issues 3 and 4\nper ../shared/FACTS.md\n"
        "stop the search when nothing improves\nthe issue's two knapsacks\n", encoding="utf-8")
    files = product_files(tmp_path)
    assert [c.split(":")[1] for c in citations(files, HISTORY_REF, tmp_path)] == ["1", "2"]
    assert [c.split(":")[1] for c in citations(files, OUTSIDE_FACTS, tmp_path)] == ["3"]
    (tmp_path / "skills" / "b.md").write_text("[ok](a.md), [gone](results/old.md#top), [web](https://x.org/y)\n")
    assert broken_links([tmp_path / "skills" / "b.md"], tmp_path) == ["skills/b.md: results/old.md"]
