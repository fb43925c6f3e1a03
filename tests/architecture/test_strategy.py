"""The strategy seam (toolkit/runtime/strategy.py): every strategy class has every member of the `Strategy`
protocol, and nothing in the package asks a strategy what it has with hasattr/getattr."""
import ast
import importlib
import inspect

from tests.conftest import REPO
from toolkit.runtime.strategy import Strategy, StrategyBase

PACKAGE = REPO / "toolkit"


def protocol_members() -> set[str]:
    """The protocol's data members (annotations) and methods/properties, as written in its class body."""
    own = {name for name, value in vars(Strategy).items()
           if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))}
    return own | set(Strategy.__annotations__)


def runtime_classes() -> list[type]:
    """Every class defined in a module under toolkit/runtime (importing each module)."""
    found = []
    for path in sorted((PACKAGE / "runtime").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        module = importlib.import_module(name)
        found += [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == name]
    return found


def strategy_classes() -> list[type]:
    """The classes the engine drives as strategies: every runtime class with the step's methods."""
    return [c for c in runtime_classes()
            if c not in (Strategy, StrategyBase) and all(hasattr(c, m) for m in ("begin_micro_step", "optimizer_step"))]


def assigned_on_self(cls: type) -> set[str]:
    """Attribute names a class (and its bases) assign as `self.<name> = ...` anywhere in its methods."""
    names = set()
    for klass in cls.__mro__:
        if klass is object or klass.__module__ == "typing":
            continue
        tree = ast.parse(inspect.getsource(inspect.getmodule(klass)))
        body = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == klass.__name__)
        for node in ast.walk(body):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            for target in targets:
                for t in ([*target.elts] if isinstance(target, ast.Tuple) else [target]):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
    return names


def test_the_strategies_are_the_six_known_ones():
    names = {c.__name__ for c in strategy_classes()}
    assert names == {"DataParallel", "OnebitAdamStrategy", "PartitionedStrategy", "Stage3Strategy", "MeshStrategy",
                     "PipelineStrategy"}


def test_every_strategy_class_has_every_protocol_member():
    members = protocol_members()
    assert {"describe_tiers", "sharded_checkpoint", "expected_bytes_per_step", "extra_state"} <= members
    missing = []
    for cls in strategy_classes():
        assert issubclass(cls, StrategyBase), f"{cls.__name__}: not a StrategyBase (toolkit/runtime/strategy.py)"
        have = {m for m in members if hasattr(cls, m)} | assigned_on_self(cls)
        missing += [f"{cls.__name__}.{m}" for m in sorted(members - have)]
    assert not missing, "strategy members the protocol asks for and the class lacks: " + ", ".join(missing)


def test_methods_keep_the_protocols_parameters():
    wrong = []
    for cls in strategy_classes():
        for name, value in vars(Strategy).items():
            if name.startswith("_") or not inspect.isfunction(value):
                continue
            want = list(inspect.signature(value).parameters)
            got = list(inspect.signature(getattr(cls, name)).parameters)
            if got != want:
                wrong.append(f"{cls.__name__}.{name}{tuple(got)} vs {tuple(want)}")
    assert not wrong, "\n".join(wrong)


def probes_on_strategies(source: str) -> list[int]:
    """Lines of hasattr/getattr calls whose first argument mentions a strategy."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")
                and node.args and "strategy" in ast.unparse(node.args[0]).lower()):
            lines.append(node.lineno)
    return lines


def test_the_probe_scan_finds_a_probe():
    assert probes_on_strategies("if hasattr(engine.strategy, 'x'):\n    pass\ny = getattr(self._strategy, n)\n") == [1, 3]
    assert probes_on_strategies("y = getattr(engine, 'dist', None)\n") == []


def test_nothing_in_the_package_probes_a_strategy_with_hasattr_or_getattr():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        found += [f"{rel}:{line}" for line in probes_on_strategies(path.read_text(encoding="utf-8"))]
    assert not found, "hasattr/getattr on a strategy (ask it through toolkit/runtime/strategy.py): " + ", ".join(found)
