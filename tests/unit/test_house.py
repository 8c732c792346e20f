"""The house rules that keep `src/loom` navigable, checked on the source itself (issue #43):
packages by job with a small root, no file over 350 lines, dependencies that point down (no
package cycle) and no import hidden inside a function to dodge one."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "loom"
MAX_LINES = 350
MAX_ROOT_MODULES = 8


def modules() -> dict[str, ast.Module]:
    """Every module of the package by dotted name, parsed."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), filename=str(path))
    return found


def loom_imports(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    """(node, imported module) for every absolute import of loom in `tree`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "loom" or node.module.startswith("loom."):
                out.append((node, node.module))
        elif isinstance(node, ast.Import):
            out += [(node, a.name) for a in node.names if a.name.split(".")[0] == "loom"]
    return out


def is_family_plan(module: str) -> bool:
    """A family's parallel plan (`loom.models.<family>.plan`): the one module of a family's
    folder that applies parallelism, so it sits above `loom.parallel`, not with the models."""
    parts = module.split(".")
    return len(parts) == 4 and parts[1] == "models" and parts[3] == "plan"


def package(module: str) -> str:
    """The package a module belongs to: `loom.trainer.step` -> `trainer`; a root module is its
    own node (`loom.errors` -> `errors`), since `cli` sits above everything and `errors` below;
    the families' plans are one node above `parallel` (`plans`)."""
    if is_family_plan(module):
        return "plans"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "loom"


def package_graph() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> the module-level edges that make it."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for name, tree in modules().items():
        for _, target in loom_imports(tree):
            if package(name) != package(target):
                graph[package(name)][package(target)].append(f"{name} -> {target}")
    return graph


def cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """Strongly connected components of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(set(graph) | {w for edges in graph.values() for w in edges}):
        if v not in index:
            visit(v)
    return found


def test_no_file_in_src_is_over_350_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by job: {long}"


def test_the_root_holds_a_handful_of_modules():
    root = sorted(p.name for p in SRC.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root


LAZY = {
    "loom.__getattr__": "`import loom` stays free of torch until `loom.fit` is used",
    "loom.cli.run_train": "the trainer loads once the flags are known good",
    "loom.cli.subcommand": "each subcommand loads only what it needs, when it runs",
    "loom.lmeval.require_lm_eval": "the harness module imports lm_eval, an optional extra",
    "loom.lmeval.build_task_evaluation": "likewise",
    "loom.commands.eval.run_tasks_eval": "likewise",
}
"""The functions that import loom modules lazily, each for the cost or the optional
dependency it defers (not to dodge a cycle: `package_graph` counts these imports too)."""


def test_no_loom_import_hides_inside_a_function():
    hidden = []
    for name, tree in modules().items():
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) \
                    and f"{name}.{fn.name}" not in LAZY:
                hidden += [f"{name}.{fn.name}: {target}" for _, target in loom_imports(fn)]
    assert not hidden, hidden


def by_name_imports(tree: ast.AST) -> list[str]:
    """`importlib.import_module("loom...")`, or of a name the reader cannot see: a module
    loaded where neither the reader nor the cycle test sees which (issue #56)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "import_module" and node.args:
            arg = node.args[0]
            if not isinstance(arg, ast.Constant) or str(arg.value).startswith("loom"):
                found.append(ast.unparse(node))
    return found


BY_NAME = {"loom.runtime.scope": ["importlib.import_module(m)"],
           "loom.parallel.tp_styles": ["importlib.import_module(TORCHAO_TP)"]}
"""Not loom's: torch's config modules named by a compiler setting (`torch._inductor.config`),
and torchao's tensor-parallel module, loaded with the float8 linears."""


def test_the_by_name_finder_sees_one():
    tree = ast.parse("importlib.import_module('loom.x')\nimportlib.import_module(n)\n"
                     "importlib.import_module('torch')")
    assert by_name_imports(tree) == ["importlib.import_module('loom.x')",
                                     "importlib.import_module(n)"]


def test_no_loom_module_is_imported_by_name():
    found = {name: calls for name, tree in modules().items() if (calls := by_name_imports(tree))}
    assert found == BY_NAME, found


def test_the_cycle_finder_sees_a_cycle():
    """The check below can fail: a graph with a two-package loop is reported."""
    graph = {"a": {"b": ["x"]}, "b": {"a": ["y"], "c": ["z"]}, "c": {}}
    assert cycles(graph) == [["a", "b"]]


def test_no_package_cycle():
    """Dependencies point down: no set of packages imports each other in a loop."""
    graph = package_graph()
    loops = cycles(graph)
    detail = {tuple(loop): {f"{a} -> {b}": graph[a][b][:2] for a in loop for b in graph[a]
                            if b in loop} for loop in loops}
    assert not loops, detail


PARALLEL_MODULES = ("torch.distributed", "loom.parallel")


def imported_modules(tree: ast.AST) -> list[str]:
    """Every absolute module name `tree` imports, loom's or not."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def parallel_imports(found: dict[str, ast.Module]) -> list[str]:
    """`module: import` for each module of `loom.models` that reaches parallelism, a family's
    plan (`models/<family>/plan.py`) aside."""
    return [f"{name}: {target}" for name, tree in found.items()
            if name.startswith("loom.models") and not is_family_plan(name)
            for target in imported_modules(tree) if target.startswith(PARALLEL_MODULES)]


def test_the_parallel_import_finder_sees_one():
    tree = ast.parse("import torch.distributed as dist\nfrom loom.parallel.mesh import x\n")
    assert parallel_imports({"loom.models.x": tree, "loom.models.x.plan": tree,
                             "loom.models.x.planning": tree}) == [
        "loom.models.x: torch.distributed", "loom.models.x: loom.parallel.mesh",
        "loom.models.x.planning: torch.distributed",
        "loom.models.x.planning: loom.parallel.mesh"]


def test_models_know_nothing_of_parallelism():
    """A model family is plain torch: sharding, collectives and meshes are applied to it from
    outside (`loom.parallel`, through the family's `plan.py`), and a family hook gets its sums
    from the trainer."""
    assert not parallel_imports(modules())


def instance_seams(tree: ast.AST) -> list[str]:
    """`x.forward = ...` and `x.__class__ = ...`: a module's behaviour swapped on the
    instance, where a wrapper or the caller's own context says it openly (issue #56)."""
    return [ast.unparse(target) for node in ast.walk(tree) if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Attribute)
            and target.attr in ("forward", "__class__")]


def test_the_seam_finder_sees_one():
    assert instance_seams(ast.parse("model.forward = f\nm.__class__ = C\nx.forwarded = 1")) \
        == ["model.forward", "m.__class__"]


def test_no_instance_seam_in_src():
    found = {name: seams for name, tree in modules().items() if (seams := instance_seams(tree))}
    assert not found, found


def test_the_layout_is_built_once_per_run(tmp_path, monkeypatch, loom_logger_restored):
    """`loom train` builds its `ParallelDims` once and hands it down (it was built by the
    CLI, `fit` and the trainer's scope, three times, issue #56)."""
    from loom.cli import run_train
    from loom.parallel.mesh import ParallelDims

    built = []
    real = ParallelDims.from_config.__func__

    def counting(cls, p, world_size):
        built.append(world_size)
        return real(cls, p, world_size)

    monkeypatch.setattr(ParallelDims, "from_config", classmethod(counting))
    code = run_train(["--model", "debug", "--n-layers", "1", "--dataset", "random",
                      "--vocab-size", "64", "--seq-len", "16", "--max-steps", "1", "--fp32",
                      "--outdir", str(tmp_path / "run")])
    assert code == 0 and built == [1], (code, built)


RESOLVERS = ("loom.config", "loom.trainer.resolve")
"""Where a `JobConfig` may be rebuilt: `loom.config` (parsing, validation, `settled`) and the
one resolver that hands it what start-up learned."""


def test_the_outdir_and_the_model_are_settled_once_per_run(tmp_path, monkeypatch,
                                                         loom_logger_restored):
    """`loom train` checks its --outdir and decides its model's implementation once (the
    CLI and `fit` both checked the folder, `fit` and the resolver both resolved the model,
    issue #56): each is counted wherever a loom module holds it."""
    import sys

    import loom.trainer.entry  # noqa: F401  (loaded before the counters go in)
    from loom.cli import run_train
    from loom.models.resolve import model_choice
    from loom.runtime.preflight import check_outdir

    calls: list[str] = []
    for real in (check_outdir, model_choice):
        def counting(*args, real=real):
            calls.append(real.__name__)
            return real(*args)

        for module in [m for n, m in sys.modules.items() if n.startswith("loom")]:
            if getattr(module, real.__name__, None) is real:
                monkeypatch.setattr(module, real.__name__, counting)
    code = run_train(["--model", "debug", "--n-layers", "1", "--dataset", "random",
                      "--vocab-size", "64", "--seq-len", "16", "--max-steps", "1", "--fp32",
                      "--outdir", str(tmp_path / "run")])
    assert code == 0 and sorted(calls) == ["check_outdir", "model_choice"], (code, calls)


def config_rewriters(found: dict[str, ast.Module]) -> set[str]:
    """`module.function` of each function outside the resolvers annotated to return a
    `JobConfig` (alone or in a tuple): a package rewriting the configuration itself."""
    out = set()
    for name, tree in found.items():
        if name == RESOLVERS[1] or name.startswith(RESOLVERS[0]):
            continue
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and fn.returns \
                    and "JobConfig" in ast.unparse(fn.returns):
                out.add(f"{name}.{fn.name}")
    return out


def test_the_rewriter_finder_sees_one():
    tree = ast.parse("def f(cfg) -> JobConfig: ...\ndef g(cfg) -> tuple[int, JobConfig]: ...\n"
                     "def h(cfg) -> dict[str, int]: ...")
    assert config_rewriters({"loom.data.x": tree, "loom.trainer.resolve": tree,
                             "loom.config.y": tree}) == {"loom.data.x.f", "loom.data.x.g"}


def test_only_the_resolvers_rewrite_the_configuration():
    """Facts flow up, one place decides (issue #56): packages return what they learned
    (`loom.config.resolved.Facts` or flag values by name) and `loom.trainer.resolve` settles
    it with `loom.config.resolved.settled`; no other function returns a `JobConfig`."""
    assert not config_rewriters(modules())
