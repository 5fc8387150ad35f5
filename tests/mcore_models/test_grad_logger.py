"""DataGradientLogger: the saved dgrads and wgrads equal autograd's, on the logged iterations only."""

import torch
from mcore_models import GPTModel, TransformerConfig
from mcore_models.debug import DataGradientLogger, is_linear_type


def test_saved_gradients_equal_autograd(run_distributed, model_parallel, tmp_path):
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))

    def body():
        torch.manual_seed(0)
        config = TransformerConfig(
            num_layers=2, hidden_size=32, num_attention_heads=4, attention_dropout=0.0, hidden_dropout=0.0
        )
        model = GPTModel(config, 64, pg_collection=model_parallel(1))
        logger = DataGradientLogger(model, tmp_path, every=2)
        # reference: the tensors entering and leaving each hooked module, with grads retained
        seen = {}

        def keep(name):
            def hook(module, inputs, output):
                out = output[0] if isinstance(output, tuple) else output
                ins = [x for x in inputs if torch.is_tensor(x) and x.requires_grad]
                for t in [out, *ins]:
                    t.retain_grad()
                seen[name] = (ins, out)

            return hook

        for name, module in logger.modules.items():
            module.register_forward_hook(keep(name))
        written = []
        for iteration in range(3):
            model.zero_grad()
            with logger.iteration(iteration):
                model(ids, labels=ids).sum().backward()
            written.append(sorted(p.name for p in tmp_path.glob("iter_*")))
        saved = torch.load(tmp_path / "iter_0000002" / "rank_0.pt")
        errors = []
        for name, (ins, out) in seen.items():
            errors.append((saved["dgrad_output"][name][0] - out.grad).abs().max().item())
            grads_in = [g for g in saved["dgrad_input"][name] if g is not None]
            errors += [(g - x.grad).abs().max().item() for g, x in zip(grads_in, ins, strict=True)]
        params = dict(model.named_parameters())
        errors += [(g - params[name].grad).abs().max().item() for name, g in saved["wgrad"].items()]
        return written, sorted(logger.modules), sorted(saved["wgrad"]), max(errors)

    ((written, modules, wgrads, error),) = run_distributed(body, 1)
    assert written == [["iter_0000000"], ["iter_0000000"], ["iter_0000000", "iter_0000002"]]
    assert "embedding.word_embeddings" in modules and "output_layer" in modules
    assert (
        "decoder.layers.1.self_attention.linear_qkv" in modules
        and "decoder.layers.0.mlp.linear_fc2" in modules
    )
    assert (
        "embedding.position_embeddings.weight" in wgrads and "decoder.layers.0.mlp.linear_fc1.bias" in wgrads
    )
    assert error == 0.0


def test_linear_types():
    assert is_linear_type(torch.nn.Linear(2, 2)) and is_linear_type(torch.nn.Embedding(2, 2))
    assert not is_linear_type(torch.nn.LayerNorm(2))
