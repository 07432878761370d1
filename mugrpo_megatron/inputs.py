"""The run's inputs, checked before any process group exists: the reward functions (every rank:
an import and a signature each) and, on global rank 0, the data: every held-out set loaded, the
training prompts tokenized into the run directory's prompt file, and every ``reward.by_source``
key matched to a source. A bad row, message, field or route is an error naming the file, row and
field or key, in seconds, with nothing written (``prompt_store.write_prompt_file`` removes what
it made), instead of after megatron's groups, the model and the engines were built.

The other ranks do not wait for this before they start their default group: they wait in its
first collective (``run_dir.agree``), for as long as ``parallel.timeout_minutes`` allows (rank 0
tokenizes ~10^4 prompts a second: 10^6 in ~2 minutes); if rank 0 stops here, torchrun stops
them. Once the groups exist, ``prompt_store.open_prompt_set`` finds the complete file and every
rank opens it.
"""

from __future__ import annotations

from pathlib import Path

from mugrpo_megatron import run_dir
from mugrpo_megatron.config import Config


def check_rewards(cfg: Config) -> None:
    """Every reward function the run may call imports and takes what the scorer gives
    (``rewards.reward_specs``); ValueError naming the setting otherwise. Every rank."""
    from mugrpo_megatron.rewards import reward_specs

    reward_specs(cfg.reward)


def load_tokenizer(cfg: Config):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.model.path,
                                         trust_remote_code=cfg.model.trust_remote_code)


def prepare_data(cfg: Config, start: str, tokenizer=None, note=lambda _: None, bar=None) -> None:
    """Global rank 0, before any process group: for a start that replaces the run directory,
    replace it first (``run_dir.replace_run``); load every held-out set (the trainer loads them
    again on every rank: a few thousand prompts); tokenize the training prompts into the run's
    prompt file unless it is there complete. ValueError for bad data, nothing written."""
    from mugrpo_megatron.data import load_eval_sets
    from mugrpo_megatron.data.prompt_store import prompt_key, prompt_paths, write_prompt_file

    if start == "replace":
        run_dir.replace_run(cfg)
    tokenizer = tokenizer or load_tokenizer(cfg)
    sets = load_eval_sets(cfg.data, tokenizer)
    path, done = prompt_paths(Path(cfg.logging.run_dir), prompt_key(cfg))
    if done.is_file():
        note(f"prompts: reusing {path}")
        return
    write_prompt_file(cfg, tokenizer, path, done, bar,
                      other_sources=sorted({p.source for prompts, _ in sets.values()
                                            for p in prompts}))
