"""Command line: ``python -m mugrpo_megatron <command>``; each command's work lives beside the code
it drives, and this module parses and dispatches.

- ``config``: print every config key with its value and docstring (after YAML and ``--set``).
- ``plan``: validate a config for a world size and print the phase schedule (``dryrun.plan``),
  and check the run's inputs as ``train`` does before it starts (``inputs.check_inputs``).
- ``train``: run Mu-GRPO (``trainer``; ``--dry-run``: the inputs checked, the layout and per-GPU
  memory, ``dryrun``).
- ``convert``: HF <-> Megatron checkpoints in any TP/PP layout (``learner.convert``).
- ``eval``: pass@k and mean@k of a checkpoint on named held-out sets (``evaluation``).
- ``score``: completions of ``data.path``'s rows scored as training scores them (``score``).
- ``rollouts``: a run's persisted rollouts of one phase, summed up and decoded (``phase.viewer``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from mugrpo_megatron import outputs
from mugrpo_megatron.config import Config
from mugrpo_megatron.config.loader import describe, load_config
from mugrpo_megatron.dryrun.memory import H100_GIB
from mugrpo_megatron.rewards.scorer import RewardFailed

DRY_RUN_GPUS_PER_NODE = 8  # an H100 node


def _load(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.overrides)


def cmd_config(args: argparse.Namespace) -> int:
    print(describe(_load(args)))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from mugrpo_megatron.dryrun import plan

    cfg = _load(args)
    text = plan(cfg, args.world_size, args.gpus_per_node, hf_config=args.hf_config)
    print(text + "\n" + _inputs(cfg, overwrite=False))
    return 0


def _inputs(cfg: Config, overwrite: bool) -> str:
    """The run's inputs as ``train`` checks them before its process groups, in words."""
    from mugrpo_megatron.inputs import check_inputs

    return "inputs (as train reads them before it starts):\n" + "\n".join(
        f"  {line}" for line in check_inputs(cfg, overwrite=overwrite))


def cmd_train(args: argparse.Namespace) -> int:
    cfg = _load(args)
    world = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    if args.dry_run:
        from mugrpo_megatron.dryrun import dry_run

        text = dry_run(cfg, world, hf_config=args.hf_config, gpu_gib=args.gpu_gib,
                       gpus_per_node=args.gpus_per_node or DRY_RUN_GPUS_PER_NODE)
        print(_inputs(cfg, overwrite=args.overwrite) + "\n" + text)
        return 0
    # before any process group (and before megatron-core is imported): the layout, with the
    # model's when its config.json is there (run_dir.check names a missing one next), and the
    # run directory
    from mugrpo_megatron import run_dir
    from mugrpo_megatron.layout import check_layout, launcher_ranks_per_node
    from mugrpo_megatron.models.hf_config import read_model_spec

    model = Path(cfg.model.path) / "config.json" if cfg.model.path else None
    check_layout(cfg, world, args.gpus_per_node or launcher_ranks_per_node(),
                 read_model_spec(model.parent) if model and model.is_file() else None)
    from mugrpo_megatron.inputs import check_rewards

    check_rewards(cfg)  # every reward function imports and takes what the scorer gives
    start = run_dir.check(cfg, overwrite=args.overwrite)  # reads only; every rank
    if start == "finished":
        if int(os.environ.get("RANK", "0")) == 0:
            print(run_dir.finished_message(cfg), flush=True)
        return 0
    from mugrpo_megatron.trainer import train

    return train(cfg, start)


def cmd_convert(args: argparse.Namespace) -> int:
    from mugrpo_megatron.learner.convert import convert

    convert(args.to, args.hf_dir if args.to == "megatron" else args.checkpoint, args.out,
            tp=args.tp, pp=args.pp, ep=args.ep, dtype=args.dtype, overwrite=args.overwrite)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from mugrpo_megatron.evaluation import evaluate_checkpoint

    cfg = _load(args)
    if not (args.model or cfg.model.path):
        raise ValueError("eval needs --model (or model.path in the config)")
    model = Path(args.model or cfg.model.path)
    if not model.is_dir():
        raise ValueError(f"{'--model' if args.model else 'model.path'}: {model} is not a "
                         f"directory (an HF checkpoint or a Megatron checkpoint)")
    out = evaluate_checkpoint(cfg, model, data=args.data,
                              limit=args.limit, samples=args.samples, output=args.output,
                              overwrite=args.overwrite)
    print(json.dumps(out, indent=1))
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    from mugrpo_megatron.score import score_file

    score_file(_load(args), Path(args.completions), out=args.out, overwrite=args.overwrite,
               explain=args.explain)
    return 0


def cmd_rollouts(args: argparse.Namespace) -> int:
    from mugrpo_megatron.phase.viewer import show_run

    print(show_run(Path(args.run_dir), args.phase, args.show, args.ids))
    return 0


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (defaults apply where it is silent)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one key, e.g. --set algo.clip_high=4.0 (repeatable)")


def _overwrite_arg(p: argparse.ArgumentParser, dest: str) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help=f"replace an existing, non-empty {dest} (written beside it, then renamed "
                        f"into place); without it such a {dest} is refused and left untouched")


def _gpus_per_node_arg(p: argparse.ArgumentParser, default_text: str) -> None:
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs (ranks) per node, to check that an engine replica's tensor-parallel "
                        f"group fits in one node ({default_text})")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m mugrpo_megatron",
                                  description="Mu-GRPO on Megatron-core with vLLM/SGLang rollouts")
    sub = top.add_subparsers(dest="command", required=True)
    p = sub.add_parser("config", help="print every config key, its value and its meaning")
    _config_args(p)
    p.set_defaults(fn=cmd_config)
    p = sub.add_parser("plan", help="validate a config for a world size and print the schedule")
    _config_args(p)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--hf-config", default=None,
                   help="an HF config.json (or its directory) for the phase-cost model, when "
                        "model.path's is not on this machine")
    _gpus_per_node_arg(p, "default: not checked")
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("train", help="train with Mu-GRPO (launch through torchrun for > 1 process)")
    _config_args(p)
    p.add_argument("--dry-run", action="store_true",
                   help="validate the config for a world size and print the layout and memory "
                        "estimate; needs no GPU")
    p.add_argument("--world-size", type=int, default=None,
                   help="world size for --dry-run (default: $WORLD_SIZE or 1)")
    p.add_argument("--hf-config", default=None,
                   help="for --dry-run: an HF config.json (or its directory) to use instead of "
                        "model.path's, when the checkpoint is not on this machine")
    p.add_argument("--gpu-gib", type=float, default=H100_GIB,
                   help=f"for --dry-run: memory per GPU, as CUDA reports it (default: an 80 GB H100's "
                        f"{H100_GIB} GiB)")
    _gpus_per_node_arg(p, f"default: torchrun's processes per node, or {DRY_RUN_GPUS_PER_NODE} "
                          f"for --dry-run")
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
    _overwrite_arg(p, "--out")
    p.set_defaults(fn=cmd_convert)
    p = sub.add_parser("eval", help="score a checkpoint (HF dir or Megatron checkpoint) on "
                                    "held-out sets: pass@k and mean@k by set and source")
    _config_args(p)
    p.add_argument("--model", help="HF directory or Megatron checkpoint (default: model.path)")
    p.add_argument("--data", action="append", default=None, metavar="[NAME=]PATH",
                   help="a held-out set (jsonl/parquet/hub id, read as data.* says), named by "
                        "NAME or its file's stem; repeatable (default: data.eval_path's sets)")
    p.add_argument("--limit", type=int, default=None,
                   help="at most this many problems a set (default: data.eval_size)")
    p.add_argument("--samples", type=int, default=None,
                   help="responses per problem (default: eval.samples): 1 decodes greedily; "
                        "more sample at eval.temperature (or rollout.temperature) for pass@k "
                        "(eval.pass_k) and mean@k")
    p.add_argument("--output", help="also write the result as JSON here")
    _overwrite_arg(p, "--output")
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("score", help="score completions of data.path's rows as training scores "
                                     "them (routing, metadata, sandbox, timeouts)")
    _config_args(p)
    p.add_argument("--completions", required=True, metavar="FILE.jsonl",
                   help='one {"row": i, "completion": "..."} a line (a mixture: "file": k too)')
    p.add_argument("--out", default=None, help="write the scores here (default: stdout)")
    p.add_argument("--explain", action="store_true",
                   help="say why each completion scores what it does (code reward: no program, "
                        "a syntax error, the first case failed and how; runs the programs again)")
    _overwrite_arg(p, "--out")
    p.set_defaults(fn=cmd_score)
    p = sub.add_parser("rollouts", help="summarise a run's rollouts of one phase and print "
                                        "decoded samples with rewards and advantages")
    p.add_argument("run_dir", help="the run directory (logging.run_dir)")
    p.add_argument("--phase", type=int, default=None, help="phase to show (default: the newest)")
    p.add_argument("--show", type=int, default=3, help="samples to print, spread over the phase")
    p.add_argument("--ids", action="store_true",
                   help="print token ids instead of decoding with the run's tokenizer")
    p.set_defaults(fn=cmd_rollouts)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except outputs.DiskFull as e:  # convert, eval --output (train reports its own)
        print(f"error: {e}", file=sys.stderr)
        return 1
    except RewardFailed as e:  # eval under reward.on_error: raise (train reports its own)
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
