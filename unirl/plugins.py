"""The extension points a config names, rewards and tools: one registry type and one resolver.

A config names a reward (``rewards: [...]``) or a tool (``rollout.tools: [...]``) in one of five ways,
and both are resolved here; loading imports exactly the module or file named and never evaluates a
string:

- a registered name (``gsm8k``, ``search``): the package's built-in modules (``builtin_modules``) are
  imported on the first lookup, so importing the package stays cheap;
- a name that a pip-installed package declares in the entry-point group (``unirl.rewards``,
  ``unirl.tools``): only that entry point is imported, and only when the name is not a built-in;
- ``path/to/file.py:function``: exactly that file is imported;
- ``package.module:function``: an importable module;
- ``http://host:port``: served by ``unirl serve-reward`` / ``unirl serve-tool``; ``Plugins.load`` makes
  the client class its caller passes (``unirl/rewards/loading.py``, ``unirl/tools/loading.py``).

``Plugins.resolve(spec)`` finds the function or class; ``Plugins.load(spec, kwargs, remote=...)`` also
checks every kwarg against its signature and binds them (or instantiates the class). ``resolve_object``
is the ``file.py:name`` / ``module:name`` half alone (``rollout.call_format`` uses it).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from unirl.registry import Registry

#: Import name -> pip distribution, where they differ (for the "install ..." hint).
_PIP_NAMES = {
    "math_verify": "math-verify", "latex2sympy2_extended": "math-verify", "PIL": "pillow", "cv2": "opencv-python",
    "sklearn": "scikit-learn", "open_clip": "open-clip-torch", "torchvision": "torchvision", "openenv": "openenv-core",
}


class Plugins(Registry):
    """A ``Registry`` of one kind of extension point, with what ``unirl rewards list`` / ``tools list`` show.

    ``builtin_modules`` register the built-ins when imported (a missing optional package makes a
    module's entries unavailable, with the pip line, while the others load); ``group`` is the
    entry-point group of installed packages; ``error`` the exception type every message is raised as;
    ``register(name, obj)`` registers an entry point's object the package's way; ``package_dir``: an
    exception raised from a file there while importing a built-in is a bug, not a missing package;
    ``skip_first``: a function's first parameter is the data (a reward's ``samples``), not a setting.
    """

    def __init__(self, kind: str, *, builtin_modules: list[str], group: str, error: type[Exception],
                 register: Callable[[str, Any], Any], package_dir: Path, skip_first: bool):
        super().__init__(kind)
        self.builtin_modules, self.group, self.error = builtin_modules, group, error
        self.register_entry_point, self.package_dir, self.skip_first = register, package_dir, skip_first
        #: name -> what the listing shows (a dataclass with a ``source`` field).
        self.info: dict[str, Any] = {}
        #: Built-in module or entry point -> why it could not be imported.
        self.unavailable: dict[str, str] = {}
        self.imported: set[str] = set()
        self.entry_points_seen: set[str] = set()

    # ------------------------------------------------------------------ resolving and loading

    def load(self, spec: str, kwargs: dict[str, Any], *, remote: type, bind: type = functools.partial) -> Any:
        """The object ``spec`` names, ready to call, with ``kwargs`` from the config applied: a function
        gets them bound (``functools.partial``), a class is instantiated once with them, an ``http://``
        URL becomes ``remote(spec, **kwargs)``. Every key of ``kwargs`` must be a named parameter: a
        misspelt setting would otherwise be swallowed by a ``**kwargs``. ``bind``: the partial type a
        function is bound with (tools bind with one that refuses a call's arguments naming a setting)."""
        if isinstance(spec, str) and spec.startswith(("http://", "https://")):
            check_kwargs(spec, remote, kwargs, kind=self.kind, error=self.error)
            return remote(spec, **kwargs)
        obj = self.resolve(spec)
        if inspect.isclass(obj):
            check_kwargs(spec, obj, kwargs, kind=self.kind, error=self.error)
            try:
                return obj(**kwargs)
            except self.error:
                raise
            except Exception as err:
                raise self.error(f"{self.kind} {spec!r}: {obj.__name__}(**{kwargs!r}) raised "
                                 f"{type(err).__name__}: {err}") from err
        if not kwargs:
            return obj
        check_kwargs(spec, obj, kwargs, kind=self.kind, error=self.error, skip_first=self.skip_first)
        bound = bind(obj, **kwargs)
        functools.update_wrapper(bound, obj)  # keep __name__/__doc__ for logs and the listing
        return bound

    def resolve(self, spec: str) -> Any:
        """The function or class ``spec`` names (not a URL), not yet bound or instantiated."""
        if not isinstance(spec, str) or not spec:
            raise self.error(f"a {self.kind} spec must be a non-empty string, got {spec!r}")
        if ":" in spec:
            return resolve_object(spec, kind=self.kind, error=self.error)
        if spec.endswith(".py"):
            raise self.error(f"{self.kind} {spec!r}: name the function too, as {spec}:function")
        self.ensure(spec)
        return self.get(spec)

    def ensure(self, name: str) -> None:
        """Make ``name`` registered (built-ins first, then an entry point of that name) or raise."""
        self.ensure_builtins()
        if name not in self:
            for ep in self.entry_points():
                if ep.name == name:
                    self.load_entry_point(ep)
        if name not in self:
            message = (f"{self.unknown_message(name)}. Or give path/to/file.py:function, package.module:function, "
                       f"http://host:port, or install a package with a {self.group!r} entry point.")
            if self.unavailable:
                what = "Rewards" if self.kind == "reward" else f"{self.kind.capitalize()}s"
                message += f" {what} that could not be loaded: " + "; ".join(self.unavailable.values())
            raise self.error(message)

    def listing(self) -> list[Any]:
        """Every registered entry's info, sorted by name: built-ins, every entry point of ``group``, and
        entries registered by modules imported so far."""
        self.ensure_builtins()
        for ep in self.entry_points():
            self.load_entry_point(ep)
        return [self.info[name] for name in self]

    # ------------------------------------------------------------------ built-ins and entry points

    def ensure_builtins(self) -> None:
        """Import each built-in module once; a missing optional dependency is recorded, not raised."""
        for module_name in self.builtin_modules:
            if module_name in self.imported:
                continue
            try:
                importlib.import_module(module_name)
            except ImportError as err:
                top = (err.name or "").split(".")[0]
                if top in ("", "rewards", "unirl"):
                    raise  # our own module is missing or broken: a bug, not an optional dependency
                pip_name = _PIP_NAMES.get(top, top)
                if isinstance(err, ModuleNotFoundError):
                    self.unavailable[module_name] = f"{module_name} needs {top!r}: pip install {pip_name}"
                else:  # the package is there but lacks a name: an incompatible version
                    self.unavailable[module_name] = (
                        f"{module_name} failed to import from {top!r} ({err}): pip install -U {pip_name}")
            except Exception as err:
                # A third-party package that raises on import (e.g. a torchvision built for another
                # torch): that module's entries are unavailable. An error in our own code is a bug.
                if raised_in(err, self.package_dir):
                    raise
                self.unavailable[module_name] = f"{module_name} failed to import: {type(err).__name__}: {err}"
            self.imported.add(module_name)

    def entry_points(self) -> list[importlib.metadata.EntryPoint]:
        # Read on every call (cheap): a package installed during the session is seen.
        return sorted(importlib.metadata.entry_points(group=self.group), key=lambda ep: ep.name)

    def load_entry_point(self, ep: importlib.metadata.EntryPoint) -> None:
        """Import the object an entry point names and register it under the entry point's name.

        A module may register the object itself under the same name (a reward sets its modality that
        way); otherwise ``register`` does. An import error is recorded as unavailable (one broken
        plugin does not stop the others); two objects under one name is an error.
        """
        key = f"{ep.name}={ep.value}"
        if key in self.entry_points_seen:
            return
        self.entry_points_seen.add(key)
        dist = getattr(ep, "dist", None)
        where = f"entry point {dist.name} {dist.version}" if dist is not None else "entry point"
        try:
            obj = ep.load()
        except Exception as err:
            self.unavailable[f"entry point {ep.name}"] = (
                f"{where} {ep.name} = {ep.value!r} failed to import: {type(err).__name__}: {err}")
            return
        source = f"{where} ({ep.value})"
        if ep.name in self and self.get(ep.name) is not obj:
            raise self.error(f"{self.kind} {ep.name!r} from {source} clashes with the {self.kind} of that name from "
                             f"{self.info[ep.name].source}; uninstall one, or register under another name")
        if ep.name not in self:
            self.register_entry_point(ep.name, obj)
        self.info[ep.name] = dataclasses.replace(self.info[ep.name], source=source)
        # Its module is imported now: register the other entry points it declares too (no further
        # import), so an object its module registered itself is listed with its entry point as source.
        for other in self.entry_points():
            if other.module == ep.module:
                self.load_entry_point(other)


# ---------------------------------------------------------------------------------------------- files, modules


def resolve_object(spec: str, *, kind: str, error: type[Exception]) -> Any:
    """The callable that ``path/to/file.py:name`` or ``package.module:name`` names; ``kind`` and
    ``error`` word and type the error that says what is missing."""
    where, attr = spec.rsplit(":", 1)
    if not where or not attr:
        raise error(f"{kind} {spec!r}: expected path/to/file.py:function or package.module:function")
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = import_file(Path(where).expanduser(), spec, kind=kind, error=error)
        origin = f"file {where}"
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as err:
            missing = f" (no module named {err.name!r})" if err.name and err.name != where else ""
            raise error(f"{kind} {spec!r}: cannot import module {where!r}{missing}") from err
        origin = f"module {where}"
    fn = getattr(module, attr, None)
    if fn is None:
        defined = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        close = difflib.get_close_matches(attr, defined, n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise error(f"{kind} {spec!r}: {origin} has no function {attr!r}.{hint}")
    if not callable(fn):
        raise error(f"{kind} {spec!r}: {attr!r} in {origin} is a {type(fn).__name__}, not a function")
    return fn


def import_file(path: Path, spec: str, *, kind: str, error: type[Exception]):
    """Import exactly ``path`` once per resolved path, under a module name of its own."""
    if not path.is_file():
        raise error(f"{kind} {spec!r}: file not found: {path}")
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    module_name = f"_unirl_file_{''.join(c if c.isalnum() else '_' for c in resolved.stem)}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise error(f"{kind} {spec!r}: cannot import {path} as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # before exec, like import does (dataclasses, pickling)
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as err:
        del sys.modules[module_name]
        raise error(f"{kind} {spec!r}: {err.filename}:{err.lineno}: syntax error: {err.msg}") from None
    except Exception as err:
        del sys.modules[module_name]
        raise error(f"{kind} {spec!r}: importing {path} failed: {type(err).__name__}: {err}") from err
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def raised_in(err: BaseException, folder: Path) -> bool:
    """Whether ``err`` comes from a file in ``folder`` (a bug of ours) rather than from a dependency."""
    if isinstance(err, SyntaxError) and err.filename:
        return Path(err.filename).resolve().parent == folder
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().parent == folder


# ---------------------------------------------------------------------------------------------- the config's kwargs


def accepted_kwargs(obj: Any, skip_first: bool = True) -> list[str] | None:
    """Names a config may set: a function's keyword parameters (after the first with ``skip_first``:
    a reward's ``samples``), or a class's constructor parameters (following ``**kwargs`` into the base
    classes). None: not introspectable."""
    if inspect.isclass(obj):
        names: list[str] = []
        for cls in obj.__mro__:
            init = cls.__dict__.get("__init__")
            if init is None:
                continue
            try:
                params = list(inspect.signature(init).parameters.values())[1:]  # drop self
            except (TypeError, ValueError):
                return None
            names += [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in names]
            if not any(p.kind == p.VAR_KEYWORD for p in params):
                break
        return names
    try:
        params = list(inspect.signature(obj).parameters.values())[1 if skip_first else 0:]
    except (TypeError, ValueError):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def check_kwargs(spec: str, obj: Any, kwargs: dict[str, Any], *, kind: str, error: type[Exception],
                 skip_first: bool = True) -> None:
    """Raise ``error`` naming the first key of ``kwargs`` that ``obj`` has no parameter for."""
    named = accepted_kwargs(obj, skip_first)
    if named is None:  # no introspectable signature: nothing to check against
        return
    for key in kwargs:
        if key not in named:
            close = difflib.get_close_matches(key, named, n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise error(f"{kind} {spec!r} has no parameter {key!r}.{hint} Its parameters: {', '.join(named) or '(none)'}")
