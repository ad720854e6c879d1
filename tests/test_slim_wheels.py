"""scripts/slim_wheels.py, which cuts the GPU machine's wheels to fit the device tool's carry: what it
drops from a wheel, the RECORD lines with it, and what it keeps."""

from __future__ import annotations

import importlib.util
import zipfile

from conftest import ROOT


def _script():
    spec = importlib.util.spec_from_file_location("slim_wheels", ROOT / "scripts" / "slim_wheels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


slim = _script()


def _wheel(path, names):
    record = "".join(f"{name},sha256=x,1\n" for name in names)
    with zipfile.ZipFile(path, "w") as z:
        for name in names:
            z.writestr(name, b"x")
        z.writestr(path.name.split("-")[0] + "-1.0.dist-info/RECORD", record)
    return path


def _members(path):
    with zipfile.ZipFile(path) as z:
        record = [line.split(",")[0] for line in z.read(next(n for n in z.namelist() if n.endswith("RECORD")))
                  .decode().splitlines() if line]
        return set(z.namelist()), set(record)


def test_sqlalchemys_cython_builds_and_timms_label_files_go_their_python_and_models_stay(tmp_path):
    sql = _wheel(tmp_path / "sqlalchemy-2.1.9-cp312-cp312-manylinux2014_x86_64.whl", [
        "sqlalchemy/engine/_row_cy.cpython-312-x86_64-linux-gnu.so", "sqlalchemy/engine/_row_cy.py",
        "sqlalchemy/util/_collections_cy.cpython-312-x86_64-linux-gnu.so", "sqlalchemy/util/_collections_cy.py"])
    timm = _wheel(tmp_path / "timm-1.0.31-py3-none-any.whl", [
        "timm/data/_info/imagenet_synsets.txt", "timm/data/imagenet_info.py", "timm/models/convnext.py"])
    slim.main(tmp_path)
    names, record = _members(sql)
    assert not any(n.endswith(".so") for n in names | record)
    assert {"sqlalchemy/engine/_row_cy.py", "sqlalchemy/util/_collections_cy.py"} <= names & record
    names, record = _members(timm)
    assert not any(n.startswith("timm/data/_info/") for n in names | record)
    assert {"timm/data/imagenet_info.py", "timm/models/convnext.py"} <= names & record
