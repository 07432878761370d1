import os
import sys
from pathlib import Path

import pytest

# No hub on CI: fail fast instead of retrying for ~20 s.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests run two at a time (pytest-xdist) beside each other's processes: OpenMP threads that
# sleep while they wait, instead of spinning, slow down in proportion on a busy machine instead of
# stalling (seen here: a torch loop 2.3x slower beside one busy process with spinning threads,
# 1.6x with sleeping ones). Every process the tests start inherits this.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# the tests' helpers, also in the processes tests spawn (multiprocessing passes sys.path on)
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    from mugrpo_megatron.models.tiny import make_tokenizer

    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


# The heaviest files first, longest first (their test seconds in a full run, 2026-12-04: 906,
# 565, 305, 249, 235, 178, 155, 97, 81, 75, 50), so that with two workers none of them is left to
# run alone at the end; scripts/test.sh keeps this order (--no-loadscope-reorder).
HEAVY_FIRST = ("test_trainer.py", "test_benchmarks.py", "test_engine_contract.py",
               "test_learner.py", "test_convert.py", "test_checkpoint.py", "test_recipes.py",
               "test_user_data.py", "test_disk_full.py", "test_collectives.py", "test_fp8.py")


def pytest_collection_modifyitems(session, config, items):
    def weight(item):
        name = Path(str(item.fspath)).name
        return HEAVY_FIRST.index(name) if name in HEAVY_FIRST else len(HEAVY_FIRST)

    items.sort(key=weight)  # stable: each file keeps its own order
