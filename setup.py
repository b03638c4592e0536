"""Only what pyproject.toml cannot say: ship ``ds_core_deepspeed.pth`` at the wheel's root.

The ``.pth`` line runs at every interpreter start and does nothing unless
``DS_CORE_DEEPSPEED=1`` (docs/interop.md, "Enabling it without code changes").
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "ds_core_deepspeed.pth"


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        shutil.copy(Path(__file__).with_name(PTH), Path(self.build_lib) / PTH)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


setup(cmdclass={"build_py": BuildWithPth})
