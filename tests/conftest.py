import os
import sys
from pathlib import Path

import pytest

# No hub on CI: fail fast instead of retrying for ~20 s.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    from mugrpo_megatron.tiny import make_tokenizer

    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))
