"""A tiny corpus, tokenizer and model for the training tests: seconds per run, not minutes."""

import dataclasses
import itertools
import shutil

import mcore_models.training.run_report as run_report_module
import pytest
import torch
from mcore_models.data.corpus import stdlib_documents
from mcore_models.data.preprocess import write_indexed_dataset
from mcore_models.data.tokenizer import train_bpe_tokenizer
from mcore_models.training import (
    DataConfig,
    SchedulerConfig,
    TrainConfigs,
    TrainingConfig,
    TrainModelConfig,
    TrainOptimizerConfig,
    build_optimizer,
    build_train_model,
    load_training_checkpoint,
)
from mcore_parallel import (
    CheckpointConfig,
    DistributedCheckpointer,
    DistributedDataParallelConfig,
    destroy_model_parallel,
    initialize_model_parallel,
)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """``DataConfig`` of twenty stdlib files (train) and five (held out) under a 300-token BPE."""
    directory = tmp_path_factory.mktemp("tiny-data")
    texts = [d.text for d in itertools.islice((d for d in stdlib_documents() if d.text.isascii()), 25)]
    tokenizer = train_bpe_tokenizer(texts[:20], vocab_size=300)
    tokenizer.save(directory / "tokenizer.json")
    write_indexed_dataset(texts[:20], directory / "train", tokenizer, progress=False)
    write_indexed_dataset(texts[20:], directory / "heldout", tokenizer, progress=False)
    return DataConfig(
        seq_length=32,
        data_path=str(directory / "train"),
        heldout_data_path=str(directory / "heldout"),
        tokenizer_file=str(directory / "tokenizer.json"),
    )


@pytest.fixture
def tiny_configs(tiny_data, tmp_path, monkeypatch):
    """``tiny_configs(output, train_iters=4, **layout)``: ``TrainConfigs`` of a 4-layer, 32-wide model.

    Layout keywords: ``tp``, ``pp``, ``vpp``, ``sp``, ``cp``, ``cp_comm_type``, ``distributed_optimizer``, ``micro``,
    ``global_batch``; ``save_interval``, ``load``, ``dropout``, ``sample_tokens``, ``async_save``; any other keyword
    is a ``TrainingConfig`` field (``fsdp=True``, ``export_hf=...``).

    The runs of a test using it (ranks forked by the test included) draw no ``loss.png``: matplotlib
    takes 0.2-0.5 s a plot on a 2-core CPU, hundreds of runs over the suite, and these tests check
    the training, not the picture (``test_cli`` checks ``mcore-train`` writes it).
    """
    monkeypatch.setattr(run_report_module, "write_loss_plot", lambda path, history, baseline: path)

    def make(
        output,
        train_iters=4,
        *,
        tp=1,
        pp=1,
        vpp=None,
        sp=False,
        cp=1,
        cp_comm_type="p2p",
        distributed_optimizer=False,
        micro=2,
        global_batch=4,
        save_interval=None,
        load=None,
        dropout=0.0,
        sample_tokens=0,
        async_save=False,
        **training,
    ):
        return TrainConfigs(
            model=TrainModelConfig(
                num_layers=4,
                hidden_size=32,
                num_attention_heads=4,
                num_query_groups=2,
                ffn_hidden_size=64,
                hidden_dropout=dropout,
                attention_dropout=dropout,
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=vpp,
                sequence_parallel=sp,
                context_parallel_size=cp,
                cp_comm_type=cp_comm_type,
            ),
            optimizer=TrainOptimizerConfig(lr=1e-2),
            scheduler=SchedulerConfig(lr_warmup_iters=1),
            data=tiny_data,
            training=TrainingConfig(
                train_iters=train_iters,
                micro_batch_size=micro,
                global_batch_size=global_batch,
                eval_interval=None,
                eval_iters=1,
                output_dir=str(output),
                sample_tokens=sample_tokens,
                progress=False,
                **training,
            ),
            ddp=DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer),
            checkpoint=CheckpointConfig(
                save=str(output / "checkpoints"),
                load=load,
                save_interval=save_interval,
                async_save=async_save,
            ),
        )

    return make


@pytest.fixture(scope="session")
def run_once():
    """``run_once(run, *args)``: ``run(*args)``, computed once a session for each ``run`` and arguments.

    A ``TrainConfigs`` argument counts without its output folder: a later call whose configs differ
    only there gets the first call's result, which names the first run's files (report
    ``output_dir``, ``checkpoint``, ``hf_export``). For the deterministic one-process oracle runs
    that several cases compare with.
    """
    results = {}

    def once(run, *args):
        key = (run, *(_without_output(a) if isinstance(a, TrainConfigs) else a for a in args))
        if key not in results:
            results[key] = run(*args)
        return results[key]

    return once


def _without_output(configs: TrainConfigs) -> str:
    """Every field of ``configs`` as text, the output folder (and so every path in it) as ``<output>``."""
    return repr(dataclasses.asdict(configs)).replace(configs.training.output_dir, "<output>")


@pytest.fixture
def checkpoint_at():
    """``checkpoint_at(source, iteration, target)``: a copy of a checkpoint folder whose latest is ``iteration``."""

    def copy(source, iteration, target):
        shutil.copytree(source, target)
        (target / "latest_checkpointed_iteration.txt").write_text(str(iteration))
        return target

    return copy


@pytest.fixture
def checkpoint_logits():
    """``checkpoint_logits(configs, vocab_size, load, tokens)`` on one rank: the logits of ``tokens``
    of the model of ``configs`` (at TP = PP = EP = 1) with the weights of the latest checkpoint under
    ``load``, read through the training resume path (``load_training_checkpoint``)."""

    def logits(configs, vocab_size, load, tokens):
        model_config = dataclasses.replace(
            configs.model,
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            virtual_pipeline_model_parallel_size=None,
            expert_model_parallel_size=1,
            sequence_parallel=False,
        )
        groups = initialize_model_parallel()
        try:
            model = build_train_model(model_config, vocab_size, groups, configs.ddp, configs.training.seed)
            optimizer = build_optimizer(model.ddp, configs.optimizer, groups)
            checkpointer = DistributedCheckpointer(CheckpointConfig(load=load))
            load_training_checkpoint(checkpointer, model, optimizer, groups.tp)
            model.train(False)
            with torch.no_grad():
                return model.chunks[0](tokens, position_ids=torch.arange(tokens.shape[1]).unsqueeze(0))
        finally:
            destroy_model_parallel()

    return logits
