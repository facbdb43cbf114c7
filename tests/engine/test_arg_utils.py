"""EngineArgs: flags generated from the dataclass, the compilation switches, validated fields."""

import argparse
import dataclasses

import pytest

from minivllm.config import CompilationConfig
from minivllm.config.compilation import CompilationMode
from minivllm.engine.arg_utils import EngineArgs, apply_torchrun_env
from minivllm.entrypoints.cli import build_parser


def engine_parser() -> argparse.ArgumentParser:
    return EngineArgs.add_cli_args(argparse.ArgumentParser())


def parse(*argv: str) -> EngineArgs:
    return EngineArgs.from_cli_args(engine_parser().parse_args(list(argv)))


def test_each_field_has_one_flag_with_the_dataclass_default():
    actions = engine_parser()._actions
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        matching = [a for a in actions if flag in a.option_strings]
        assert len(matching) == 1, flag
        assert matching[0].dest == f.name and matching[0].default == f.default, flag
    # `--compile` is the one flag that is not a field: a spelling of --no-enforce-eager.
    dests = {f.name for f in dataclasses.fields(EngineArgs)}
    extra = [a.option_strings for a in actions if a.dest in dests
             and not any(s == "--" + a.dest.replace("_", "-") for s in a.option_strings)]
    assert extra == [["--compile"]]
    assert parse() == EngineArgs()


def test_existing_flags_keep_their_meaning():
    args = parse("-tp", "2", "-pp", "3", "--no-enable-prefix-caching", "--dtype", "bfloat16",
                 "--max-num-seqs", "4", "--master-port", "5", "--block-size", "8")
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 3)
    assert args.enable_prefix_caching is False and args.dtype == "bfloat16"
    assert (args.max_num_seqs, args.master_port, args.block_size) == (4, 5, 8)
    assert parse("--enable-prefix-caching").enable_prefix_caching is True
    assert parse("--logits-processors", "pkg.mod:Proc", "pkg.mod.Other").logits_processors == \
        ["pkg.mod:Proc", "pkg.mod.Other"]
    for cmd in (["generate", "hi"], ["chat"], ["serve"], ["bench", "latency"], ["bench", "throughput"]):
        assert EngineArgs.from_cli_args(build_parser().parse_args(cmd + ["-tp", "3"])) == \
            EngineArgs(tensor_parallel_size=3)


def test_bad_choice_names_the_valid_ones(capsys):
    with pytest.raises(SystemExit):
        engine_parser().parse_args(["--dtype", "int3"])
    assert "choose from 'auto', 'float32', 'bfloat16', 'float16'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        engine_parser().parse_args(["-O", "fast"])
    assert "compilation mode (0, 1, 2, 3)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, mode", [
    ([], CompilationMode.NONE),
    (["--enforce-eager"], CompilationMode.NONE),
    (["--no-enforce-eager"], CompilationMode.VLLM_COMPILE),
    (["--compile"], CompilationMode.VLLM_COMPILE),
    (["--compile", "-O", "1"], CompilationMode.STOCK_TORCH_COMPILE),   # an explicit mode wins
    (["-O2"], CompilationMode.DYNAMO_TRACE_ONCE),
    (["--compilation-config", '{"mode": 3, "backend": "eager"}'], CompilationMode.VLLM_COMPILE),
])
def test_enforce_eager_and_compile_set_the_mode(argv, mode):
    assert parse(*argv)._compilation_config().mode == mode


def test_compilation_config_passes_through_and_bad_values_name_the_choices():
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE)
    assert EngineArgs(compilation_config=cc)._compilation_config() is cc
    assert parse("-O", '{"backend": "eager"}')._compilation_config().backend == "eager"
    with pytest.raises(ValueError, match=r"choose one of 0 \(NONE\), 1 .*3 \(VLLM_COMPILE\)"):
        EngineArgs(compilation_config=7)._compilation_config()
    with pytest.raises(ValueError, match=r"Unknown compilation_config key\(s\) \['modes'\].*mode"):
        EngineArgs(compilation_config={"modes": 3})._compilation_config()


def test_scheduler_fields_are_validated(tiny_llama_factory):
    path = tiny_llama_factory()
    with pytest.raises(ValueError, match="enable_chunked_prefill must be True"):
        EngineArgs(model=path, enable_chunked_prefill=False).create_engine_config()
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        EngineArgs(model=path, long_prefill_token_threshold=-1).create_engine_config()
    config = EngineArgs(model=path, long_prefill_token_threshold=8).create_engine_config()
    assert config.scheduler_config.long_prefill_token_threshold == 8
    with pytest.raises(SystemExit):
        engine_parser().parse_args(["--no-enable-chunked-prefill", "--bogus"])
    assert parse("--no-enable-chunked-prefill").enable_chunked_prefill is False


def test_unknown_engine_argument_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"Unknown engine argument\(s\) enable_chunked_prefil;.*"
                                         r"enable_chunked_prefill"):
        EngineArgs.from_kwargs(enable_chunked_prefil=True)
    assert EngineArgs.from_kwargs(seed=3) == EngineArgs(seed=3)


def test_torchrun_environment_fills_node_flags(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "29400")
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    args = apply_torchrun_env(EngineArgs(tensor_parallel_size=2))
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port) == (2, 1, "10.0.0.7", 29401)
    explicit = EngineArgs(nnodes=3, node_rank=2)           # explicit flags win
    assert apply_torchrun_env(explicit) is explicit
