"""Counts, per process, the opens of one file and the calls of the config readers and validators (for
tests/dist/test_train_cli.py: a self-spawned `dsv3 train` reads its config once). Active when this folder is
first on PYTHONPATH and DSV3_COUNT_DIR is set: every process (the launcher, each spawned rank) appends one line
per event to DSV3_COUNT_DIR/<pid>.log: `start`, `open` (of DSV3_COUNT_FILE) or the function's name.
No production code knows of it: the functions are wrapped here, before any other module imports them."""

import os
import sys

_DIR = os.environ.get("DSV3_COUNT_DIR")


def _install() -> None:
    def log(what: str) -> None:
        # by the pid at the time of the call: ranks forked from a forkserver count as processes of their own
        fd = os.open(os.path.join(_DIR, f"{os.getpid()}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            os.write(fd, (what + "\n").encode())
        finally:
            os.close(fd)

    log("start")
    target = os.environ.get("DSV3_COUNT_FILE")
    if target:
        target = os.path.realpath(target)

        def hook(event, args):
            if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
                p = os.fsdecode(args[0])
                if p.endswith(os.path.basename(target)) and os.path.realpath(p) == target:
                    log("open")

        sys.addaudithook(hook)

    import importlib

    def wrap(module_names, name):
        mods = []
        for m in module_names:
            try:
                mods.append(importlib.import_module(m))
            except ImportError:
                continue
        fns = {id(getattr(m, name)): getattr(m, name) for m in mods if hasattr(m, name)}
        for fn in fns.values():

            def counted(*a, __fn=fn, **k):
                log(name)
                return __fn(*a, **k)

            for m in mods:
                if getattr(m, name, None) is fn:
                    setattr(m, name, counted)

    config_modules = ["dsv3_plugin.config", "dsv3_plugin.config.loading", "dsv3_plugin.config.schema"]
    wrap(config_modules, "read_ds_json")
    wrap(config_modules, "load_config")
    wrap(config_modules, "check_numbers")
    wrap(["dsv3_plugin.deepspeed.validate", "dsv3_plugin.deepspeed.run_config"], "validate_ds_config")
    wrap(["dsv3_plugin.parallel.distributed"], "init_distributed")  # once per rank: tells ranks apart
    cls = importlib.import_module("dsv3_plugin.config").DSv3Config
    if hasattr(cls, "from_block"):
        block = cls.from_block.__func__

        def from_block(c, *a, **k):
            log("from_block")
            return block(c, *a, **k)

        cls.from_block = classmethod(from_block)


if _DIR:
    _install()
