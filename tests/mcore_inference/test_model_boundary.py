"""mcore_inference uses nothing of a model but the members of ``mcore_models.InferenceModel`` (its
optional ones through ``mamba_state_config_of``) and writes nothing to it: statically (every use
of the model in the package's source) and at run time on pipeline stages (a proxy that records
what is read of the model and refuses writes)."""

import ast
from pathlib import Path

import mcore_inference
from mcore_inference import SamplingParams
from mcore_models import OPTIONAL_INFERENCE_MEMBERS, missing_inference_members

MEMBERS = frozenset(missing_inference_members(object())) | frozenset(OPTIONAL_INFERENCE_MEMBERS)
SOURCE = sorted(Path(mcore_inference.__file__).parent.glob("*.py"))
# What the source may do with a model besides reading members: check it, name its type, or hand it
# to its own functions (whose ``model`` parameters the same rules cover).
FOREIGN_CALLS_TAKING_THE_MODEL = {"missing_inference_members", "mamba_state_config_of", "type"}
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, num_tokens_to_generate=5)


def _is_model(node):
    """``model`` or ``self.model``: the only names the source gives a model."""
    if isinstance(node, ast.Name):
        return node.id == "model"
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "model"
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _callee(call):
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _own_functions():
    return {
        node.name
        for path in SOURCE
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.ClassDef))
    }


def _model_uses(path, own):
    """``(line, what)`` for every use of a model in ``path`` that is not allowed."""
    tree, bad = ast.parse(path.read_text()), []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg):
            annotation = ast.unparse(node.annotation) if node.annotation is not None else None
            if (node.arg == "model") != (annotation == "InferenceModel") and annotation != "object":
                bad.append((node.lineno, f"parameter {node.arg}: {annotation}"))
        elif isinstance(node, ast.Attribute) and _is_model(node.value):
            if node.attr not in MEMBERS:
                bad.append((node.lineno, f"reads model.{node.attr}"))
            if not isinstance(node.ctx, ast.Load):
                bad.append((node.lineno, f"writes model.{node.attr}"))
        elif isinstance(node, ast.Call):
            if _is_model(node.func):
                bad.append((node.lineno, "calls the model (nn.Module.__call__)"))
            passed = any(_is_model(arg) for arg in [*node.args, *(k.value for k in node.keywords)])
            callee = _callee(node)
            if passed and callee not in FOREIGN_CALLS_TAKING_THE_MODEL and callee not in own:
                bad.append((node.lineno, f"passes the model to {callee}"))
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and _is_model(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if not all(ast.unparse(t) == "self.model" for t in targets):
                bad.append((node.lineno, f"aliases the model as {', '.join(map(ast.unparse, targets))}"))
    return [(path.name, line, what) for line, what in bad]


# The one place the engine hands its model out: ``update_weights(load)`` gives it to the caller's
# ``load``, whose purpose is to write new weights into it.
CALLER_WRITES = {("engine.py", "passes the model to load")}


def test_the_source_touches_only_protocol_members():
    own = _own_functions()
    assert SOURCE and {"engine.py", "pipeline.py", "context.py", "cuda_graphs.py"} <= {p.name for p in SOURCE}
    uses = [use for path in SOURCE for use in _model_uses(path, own)]
    assert [u for u in uses if (u[0], u[2]) not in CALLER_WRITES] == []
    assert {(u[0], u[2]) for u in uses} == CALLER_WRITES  # the exception is still needed


def test_the_static_check_catches_what_it_should(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f(model: InferenceModel, net):\n"
        "    model.eval()\n"
        "    model.parallel_output = False\n"
        "    m = model\n"
        "    setattr(model, 'x', 1)\n"
        "    return model(1), model.vocab_size\n"
        "def g(net: InferenceModel): ...\n"
    )
    found = sorted(what for _, _, what in _model_uses(bad, own={"f", "g"}))
    assert found == [
        "aliases the model as m",
        "calls the model (nn.Module.__call__)",
        "parameter net: InferenceModel",
        "passes the model to setattr",
        "reads model.eval",
        "reads model.parallel_output",
        "writes model.parallel_output",
    ]


def test_pipeline_stages_read_only_protocol_members(
    run_distributed, split_model_builder, make_engine, oracle, recording_model
):
    """On one rank, ``test_model_protocol``'s unchanged-model test runs the engine on a proxy."""

    def body():
        stage, whole = split_model_builder(pp=2)
        recording = recording_model(stage)
        (request,) = make_engine(recording).generate([[3, 1, 4, 1, 5]], GREEDY)
        assert request.generated_tokens == oracle(whole, [3, 1, 4, 1, 5], 5)
        return sorted(recording.read - MEMBERS), "inference_forward" in recording.read

    assert run_distributed(body, 2, timeout=60) == [([], True), ([], True)]
