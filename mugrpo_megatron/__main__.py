"""Command line: ``python -m mugrpo_megatron <command>``.

- ``config``: print every config key with its value and docstring (after YAML and ``--set``).
- ``plan``: validate a config for a world size and print the phase schedule.
- ``train``: run Mu-GRPO (``--dry-run``: layout and per-GPU memory estimate, no GPU needed).
"""

from __future__ import annotations

import argparse
import sys

from mugrpo_megatron.config import Config, describe, load_config


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (defaults apply where it is silent)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one key, e.g. --set algo.clip_high=4.0 (repeatable)")


def _load(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.overrides)


def cmd_config(args: argparse.Namespace) -> int:
    print(describe(_load(args)))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    cfg = _load(args)
    dp = cfg.check_world_size(args.world_size)
    a, r = cfg.algo, cfg.rollout
    samples = a.prompts_per_phase * r.group_size
    print(f"world size {args.world_size}: TP {cfg.parallel.tensor} x PP {cfg.parallel.pipeline} "
          f"x DP {dp}; engine {r.engine} at TP {r.tensor_parallel}")
    print(f"{a.num_phases} phases x mu={a.updates_per_phase} updates = {a.total_updates} updates, "
          f"{a.num_phases} weight syncs")
    print(f"each phase: {a.prompts_per_phase} prompts x G={r.group_size} = {samples} responses; "
          f"{a.samples_per_update} responses per update "
          f"({a.updates_per_phase * a.samples_per_update / samples:.2f} epochs over the phase's data)")
    print(f"clip ratio to [{1 - a.clip_low:g}, {1 + a.clip_high:g}]; veto "
          + ("off" if a.veto_threshold is None else f"below {a.veto_threshold:g}, scope {a.veto_scope}"))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import os

    cfg = _load(args)
    world = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    cfg.check_world_size(world)  # before any process group exists
    if args.dry_run:
        from mugrpo_megatron.dryrun import dry_run

        print(dry_run(cfg, world, hf_config=args.hf_config, gpu_gib=args.gpu_gib))
        return 0
    from mugrpo_megatron.trainer import RunFailed, Trainer

    trainer = Trainer(cfg)
    try:
        trainer.run()
    except RunFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        trainer.close()
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
    p.set_defaults(fn=cmd_train)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
