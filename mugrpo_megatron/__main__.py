"""Command line: ``python -m mugrpo_megatron <command>``.

- ``config``: print every config key with its value and docstring (after YAML and ``--set``).
- ``plan``: validate a config for a world size and print the phase schedule.
- ``train``: run Mu-GRPO (``--dry-run``: layout and per-GPU memory estimate, no GPU needed).
- ``convert``: HF <-> Megatron checkpoints in any TP/PP layout.
- ``eval``: pass@1 / mean@k / pass@k of a checkpoint on a local math benchmark file.
- ``rollouts``: a run's persisted rollouts of one phase: summary and decoded samples.
"""

from __future__ import annotations

import argparse
import sys

from mugrpo_megatron import outputs
from mugrpo_megatron.config import Config
from mugrpo_megatron.config.loader import describe, load_config

DRY_RUN_GPUS_PER_NODE = 8  # an H100 node


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (defaults apply where it is silent)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one key, e.g. --set algo.clip_high=4.0 (repeatable)")


def _add_overwrite_arg(p: argparse.ArgumentParser, dest: str) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help=f"replace an existing, non-empty {dest} (written beside it, then renamed "
                        f"into place); without it such a {dest} is refused and left untouched")


def _add_gpus_per_node_arg(p: argparse.ArgumentParser, default_text: str) -> None:
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs (ranks) per node, to check that an engine replica's tensor-parallel "
                        f"group fits in one node ({default_text})")


def _load(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.overrides)


def cmd_config(args: argparse.Namespace) -> int:
    print(describe(_load(args)))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    cfg = _load(args)
    from mugrpo_megatron.layout import check_layout
    from mugrpo_megatron.phase.schedule import describe_schedule

    layout = check_layout(cfg, args.world_size, args.gpus_per_node)
    a = cfg.algo
    print(f"world size {args.world_size}: TP {cfg.parallel.tensor} x PP {cfg.parallel.pipeline} "
          f"x DP {layout.data_parallel}; {layout.placement.describe()}")
    print(f"schedule: {describe_schedule(cfg)}")
    print(f"clip ratio to [{1 - a.clip_low:g}, {1 + a.clip_high:g}]; veto "
          + ("off" if a.veto_threshold is None else f"below {a.veto_threshold:g}, scope {a.veto_scope}"))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import os

    cfg = _load(args)
    world = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    if args.dry_run:
        from mugrpo_megatron.dryrun import dry_run

        print(dry_run(cfg, world, hf_config=args.hf_config, gpu_gib=args.gpu_gib,
                      gpus_per_node=args.gpus_per_node or DRY_RUN_GPUS_PER_NODE))
        return 0
    # before any process group exists: the layout (with the model's, when its config.json is
    # there: run_dir.check names a missing one next) and the engines' placement over the nodes
    from pathlib import Path

    from mugrpo_megatron.layout import check_layout, launcher_ranks_per_node
    from mugrpo_megatron.models.hf_config import read_model_spec

    model = Path(cfg.model.path) / "config.json" if cfg.model.path else None
    check_layout(cfg, world, args.gpus_per_node or launcher_ranks_per_node(),
                 read_model_spec(model.parent) if model and model.is_file() else None)
    from mugrpo_megatron import distributed, run_dir

    start = run_dir.check(cfg, overwrite=args.overwrite)  # reads only; every rank, before groups
    # then, before any model, engine or data: the ranks agree that they share one run directory
    distributed.init_default_group(cfg.parallel.timeout_minutes)
    start = run_dir.agree(cfg, start)
    from mugrpo_megatron.trainer import Trainer

    trainer = None
    try:
        trainer = Trainer(cfg, start)
        trainer.run()
    except (outputs.RunFailed, outputs.DiskFull, distributed.RemoteFailure) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as e:
        if not distributed.is_collective_timeout(e):
            raise
        # said before the clean-up, which may itself wait on the rank that stopped answering
        print(f"error: {distributed.timeout_explanation(cfg.parallel.timeout_minutes)}\n"
              f"({type(e).__name__}: {str(e)[:500]})", file=sys.stderr, flush=True)
        return 1
    finally:
        if trainer is not None:
            trainer.close()
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from mugrpo_megatron.config import ModelConfig, ParallelConfig
    from mugrpo_megatron.layout import check_model
    from mugrpo_megatron.models.hf_config import read_model_spec

    source, flag = (args.hf_dir, "--hf-dir") if args.to == "megatron" else (args.checkpoint,
                                                                          "--checkpoint")
    if not source:
        raise ValueError(f"--to {args.to} needs {flag}")
    if not Path(source).is_dir():
        raise ValueError(f"{flag}: {source} is not a directory")
    from mugrpo_megatron.learner.checkpoint import HF_CONFIG_DIR

    hf = Path(source) if args.to == "megatron" else Path(source) / HF_CONFIG_DIR
    if not (hf / "config.json").is_file():
        raise ValueError(f"{flag}: {source} has no {'' if args.to == 'megatron' else HF_CONFIG_DIR + '/'}"
                         f"config.json" + ("" if args.to == "megatron" else ": it was not written "
                                           "by mugrpo_megatron, so its architecture is unknown"))
    spec = read_model_spec(hf)
    # megatron-core builds a mixture-of-experts model at TP > 1 only with sequence parallel, which
    # changes no weight: a conversion of one turns it on, and says so
    sequence_parallel = spec.is_moe and args.tp > 1
    if sequence_parallel:
        print("note: sequence parallel on (megatron-core needs it for a mixture-of-experts model at "
              "--tp > 1; no weight depends on it)")
    parallel = ParallelConfig(tensor=args.tp, pipeline=args.pp, expert=args.ep,
                              sequence_parallel=sequence_parallel, distributed_optimizer=False)
    # the layout, before any process group
    parallel.data_parallel(int(os.environ.get("WORLD_SIZE", "1")))
    check_model(spec, ModelConfig(path=str(hf), dtype=args.dtype), parallel)
    outputs.check_destination(args.out, [source], overwrite=args.overwrite)
    from mugrpo_megatron.learner import convert

    if args.to == "megatron":
        convert.hf_to_megatron(Path(source), Path(args.out), parallel, args.dtype)
    else:
        convert.megatron_to_hf(Path(source), Path(args.out), parallel, args.dtype)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import json
    import tempfile
    from dataclasses import replace
    from pathlib import Path

    cfg = _load(args)
    if not (args.model or cfg.model.path):
        raise ValueError("eval needs --model (or model.path in the config)")
    model = Path(args.model or cfg.model.path)
    if not model.is_dir():
        raise ValueError(f"{'--model' if args.model else 'model.path'}: {model} is not a "
                         f"directory (an HF checkpoint or a Megatron checkpoint)")
    if args.output:
        outputs.check_destination(args.output, [model], overwrite=args.overwrite, what="--output",
                                  directory=False)
    with tempfile.TemporaryDirectory() as tmp:
        if (model / "state.json").is_file() or (model / ".metadata").is_file():
            # a Megatron checkpoint (complete or not: loading names what is wrong): to HF first
            from mugrpo_megatron.config import ParallelConfig
            from mugrpo_megatron.learner.convert import megatron_to_hf

            megatron_to_hf(model, Path(tmp) / "hf", ParallelConfig(distributed_optimizer=False),
                           cfg.model.dtype)
            model = Path(tmp) / "hf"
        from transformers import AutoTokenizer

        from mugrpo_megatron.data import load_prompts
        from mugrpo_megatron.engines import make_engine
        from mugrpo_megatron.evaluation import evaluate
        from mugrpo_megatron.rewards import RewardScorer

        tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=cfg.model.trust_remote_code)
        data = cfg.data if args.data is None else replace(cfg.data, eval_path=args.data,
                                                          eval_size=args.limit)
        prompts, report = load_prompts(data, tokenizer, held_out=True)
        print(f"[eval] {report.summary()}")
        engine = make_engine(cfg.rollout, model, dtype=cfg.model.dtype,
                             max_model_len=cfg.max_sequence_tokens,
                             trust_remote_code=cfg.model.trust_remote_code)
        try:
            with RewardScorer(cfg.reward) as scorer:
                res = evaluate(engine, scorer, tokenizer, prompts, k=args.samples,
                               max_new_tokens=cfg.rollout.max_new_tokens,
                               temperature=cfg.rollout.temperature, seed=cfg.rollout.seed)
        finally:
            engine.shutdown()
    out = {"model": str(args.model or cfg.model.path), "data": str(data.eval_path),
           "pass@1" if args.samples == 1 else f"mean@{args.samples}": res.mean_at_k,
           f"pass@{args.samples}": res.pass_at_k, **res.as_dict()}
    print(json.dumps(out, indent=1))
    if args.output:
        outputs.write_file(args.output, json.dumps(out, indent=1))
    return 0


def cmd_rollouts(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mugrpo_megatron.phase.viewer import phase_files, show

    run_dir = Path(args.run_dir)
    if not (run_dir / "rollouts").is_dir():
        raise ValueError(f"{run_dir}: not a run directory with rollouts (no rollouts/ in it)")
    phase = args.phase
    if phase is None:  # the newest phase on disk
        phase = max(int(p.name.split("_")[1]) for p in (run_dir / "rollouts").glob("phase_*"))
    phase_files(run_dir, phase)  # a missing phase is named before the tokenizer loads
    tokenizer = None
    if not args.ids:
        cfg = load_config(str(run_dir / "config.yaml"), [])
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    print(show(run_dir, phase, args.show, tokenizer))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mugrpo_megatron",
                                     description="Mu-GRPO on Megatron-core with vLLM/SGLang rollouts")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("config", help="print every config key, its value and its meaning")
    _add_config_args(p)
    p.set_defaults(fn=cmd_config)
    p = sub.add_parser("plan", help="validate a config for a world size and print the schedule")
    _add_config_args(p)
    p.add_argument("--world-size", type=int, default=1)
    _add_gpus_per_node_arg(p, "default: not checked")
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("train", help="train with Mu-GRPO (launch through torchrun for > 1 process)")
    _add_config_args(p)
    p.add_argument("--dry-run", action="store_true",
                   help="validate the config for a world size and print the layout and memory "
                        "estimate; needs no GPU")
    p.add_argument("--world-size", type=int, default=None,
                   help="world size for --dry-run (default: $WORLD_SIZE or 1)")
    p.add_argument("--hf-config", default=None,
                   help="for --dry-run: an HF config.json (or its directory) to use instead of "
                        "model.path's, when the checkpoint is not on this machine")
    p.add_argument("--gpu-gib", type=float, default=80.0, help="for --dry-run: memory per GPU")
    _add_gpus_per_node_arg(p, f"default: torchrun's processes per node, or "
                              f"{DRY_RUN_GPUS_PER_NODE} for --dry-run")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing logging.run_dir (its rollouts, checkpoints and "
                        "metrics are deleted) instead of resuming it or refusing it")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("convert", help="HF <-> Megatron checkpoints (torchrun for N > 1 processes)")
    p.add_argument("--to", choices=["megatron", "hf"], required=True)
    p.add_argument("--hf-dir", help="HF checkpoint to read (--to megatron)")
    p.add_argument("--checkpoint", help="Megatron checkpoint to read (--to hf)")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size to convert with")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to convert with")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size (MoE models; divides the data-parallel size)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    _add_overwrite_arg(p, "--out")
    p.set_defaults(fn=cmd_convert)
    p = sub.add_parser("eval", help="score a checkpoint (HF dir or Megatron checkpoint) on a "
                                    "local math benchmark file")
    _add_config_args(p)
    p.add_argument("--model", help="HF directory or Megatron checkpoint (default: model.path)")
    p.add_argument("--data", help="benchmark file (jsonl/parquet; default: data.eval_path)")
    p.add_argument("--limit", type=int, default=1_000_000, help="at most this many problems")
    p.add_argument("--samples", type=int, default=1,
                   help="k responses per problem: 1 decodes greedily (pass@1); k > 1 samples at "
                        "rollout.temperature and reports mean@k and pass@k")
    p.add_argument("--output", help="also write the result as JSON here")
    _add_overwrite_arg(p, "--output")
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("rollouts", help="summarise a run's rollouts of one phase and print "
                                        "decoded samples with rewards and advantages")
    p.add_argument("run_dir", help="the run directory (logging.run_dir)")
    p.add_argument("--phase", type=int, default=None, help="phase to show (default: the newest)")
    p.add_argument("--show", type=int, default=3, help="samples to print, spread over the phase")
    p.add_argument("--ids", action="store_true",
                   help="print token ids instead of decoding with the run's tokenizer")
    p.set_defaults(fn=cmd_rollouts)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except outputs.DiskFull as e:  # convert, eval --output (train reports its own)
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
