"""Where trial workers keep compiled graphs (autotune.cache): autotune's persistent cache unless the
user chose another, even once torch has written its own default into the search's environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from autotune.cache import INDUCTOR_ENV, users_inductor_cache
from autotune.trial.process import worker_env

REQUEST = {"workload": {"model": "resnet50"}, "device": "cuda"}


def test_torchs_own_default_in_the_environment_does_not_take_the_workers_away_from_autotunes_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the H200 the search process of a torchvision model imported torch._dynamo (torchvision's
    models do) before its first trial, which set TORCHINDUCTOR_CACHE_DIR to /tmp/torchinductor_<user>;
    the workers then compiled there, and a search "with empty caches" loaded its predecessor's graphs."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(INDUCTOR_ENV, raising=False)
    cache_dir()  # what importing torch._dynamo does in a process without the variable
    assert os.environ[INDUCTOR_ENV] == os.path.abspath(default_cache_dir())
    assert users_inductor_cache() is None
    assert worker_env(REQUEST)[INDUCTOR_ENV] == str(tmp_path / "compile")


def test_a_users_own_inductor_cache_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "autotune"))
    monkeypatch.setenv(INDUCTOR_ENV, str(tmp_path / "mine"))
    assert users_inductor_cache() == str(tmp_path / "mine")
    assert worker_env(REQUEST)[INDUCTOR_ENV] == str(tmp_path / "mine")
    monkeypatch.delenv(INDUCTOR_ENV)
    assert worker_env(REQUEST)[INDUCTOR_ENV] == str(tmp_path / "autotune" / "compile")
