"""The sandbox's child process (``unirl/agents/sandbox.py``): locks itself down, then runs the program and its
tests. Copied into the scratch folder and run there by path with ``python -I -S``: standard library only,
nothing imported from unirl (the child may not be able to read the installed package).

    python -I -S harness.py SETTINGS_JSON

In order, before any of the program's code runs: resource limits (CPU seconds, address space, file
size, open files, processes, no core files); the network namespace of its own (empty: no interfaces but
loopback, which is down) where the process may create one; Landlock rules letting it write only inside
its scratch folder (and ``/dev/null``) and, from Landlock ABI 4, connect or bind no TCP port; then,
when it started as root with an unprivileged user given, that user's identity. What could be set is
written to stderr's first line as ``#protections {json}``.

The program runs in this process (``exec`` of its source as ``__main__``), then the tests' source in
the same namespace; an ``AssertionError`` is a failed test (exit 3), a ``MemoryError`` exit 4, a write
past the file-size limit exit 6, a syntax error exit 2, any other exception exit 1, and ``SystemExit``
(the program leaving early) exit 5. Only a
run that reaches the end of the tests writes the verdict (the nonce the parent gave) to the verdict
pipe: a program that exits with 0 before its tests does not pass.
"""

import ctypes
import json
import os
import resource
import sys
import traceback

LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446  # the same on every arch
#: Filesystem accesses that change something (Landlock's bits), by the ABI that added them.
WRITES = {1: (1 << 1) | sum(1 << b for b in range(4, 13)), 2: 1 << 13, 3: 1 << 14}
NET_TCP = (1 << 0) | (1 << 1)  # bind, connect (ABI 4)
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000


class RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64)]


class PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def limit(settings, libc):
    """Every protection that could be set, as ``{name: how}`` (False: not set, and why)."""
    done = {}
    rl = [(resource.RLIMIT_CPU, settings["cpu_s"], "cpu_time"), (resource.RLIMIT_AS, settings["memory_mb"] << 20, "memory"),
          (resource.RLIMIT_FSIZE, settings["file_size_mb"] << 20, "file_size"),
          (resource.RLIMIT_NOFILE, settings["open_files"], "open_files"), (resource.RLIMIT_CORE, 0, None)]
    for which, value, name in rl:
        resource.setrlimit(which, (value, value + (1 if which == resource.RLIMIT_CPU else 0)))
        if name:
            done[name] = f"rlimit {value}"
    resource.setrlimit(resource.RLIMIT_NPROC, (settings["nproc"], settings["nproc"]))
    root = os.geteuid() == 0
    done["processes"] = (f"rlimit {settings['nproc']} tasks of uid {settings['uid']}" if settings["uid"] is not None
                         else f"rlimit {settings['nproc']} tasks of uid {os.getuid()} (this user's, all together)"
                         if not root else "not limited (root is exempt from RLIMIT_NPROC and no user to drop to)")
    done["network"] = _own_network(libc, root)
    done["filesystem"], abi = _landlock(libc, settings["scratch"])
    if abi >= 4 and done["network"] is False:
        done["network"] = "Landlock: no TCP connect or bind"
    if settings["uid"] is not None:
        os.setgroups([])
        os.setgid(settings["uid"])
        os.setuid(settings["uid"])
        done["user"] = f"uid {settings['uid']}"
    return done


def _own_network(libc, root):
    flags = CLONE_NEWNET if root else CLONE_NEWUSER | CLONE_NEWNET
    if libc.unshare(flags) == 0:
        return "own network namespace (no interfaces)"
    return False


def _landlock(libc, scratch):
    abi = libc.syscall(LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return f"not restricted (Landlock unavailable: {os.strerror(ctypes.get_errno())})", 0
    writes = sum(bits for version, bits in WRITES.items() if version <= abi)
    attr = RulesetAttr(writes, NET_TCP if abi >= 4 else 0)
    size = ctypes.sizeof(attr) if abi >= 4 else 8
    ruleset = libc.syscall(LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        return f"not restricted (landlock_create_ruleset: {os.strerror(ctypes.get_errno())})", 0
    for path, allowed in ((scratch, writes), ("/dev/null", (1 << 1) | (WRITES[3] if abi >= 3 else 0))):
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = PathBeneath(allowed, fd)
        if libc.syscall(LANDLOCK_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0) != 0:
            return f"not restricted (landlock_add_rule {path}: {os.strerror(ctypes.get_errno())})", 0
        os.close(fd)
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.syscall(LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:  # 38: NO_NEW_PRIVS
        return f"not restricted (landlock_restrict_self: {os.strerror(ctypes.get_errno())})", 0
    os.close(ruleset)
    return f"Landlock ABI {abi}: writes only inside the scratch folder", abi


def main():
    settings = json.loads(sys.argv[1])
    verdict = os.fdopen(settings["verdict_fd"], "w")
    nonce = settings.pop("nonce")
    libc = ctypes.CDLL(None, use_errno=True)
    sys.stderr.write("#protections " + json.dumps(limit(settings, libc)) + "\n")
    sys.stderr.flush()
    del libc
    sys.argv = ["main.py"]
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    code = {}
    try:
        for name in ("main.py", "tests.py"):
            with open(name) as f:
                code[name] = compile(f.read(), name, "exec")
    except SyntaxError:
        traceback.print_exc()
        os._exit(2)
    try:
        exec(code["main.py"], namespace)
        if "tests.py" in code:
            exec(code["tests.py"], namespace)
    except SystemExit as exit_:
        sys.stderr.write(f"#exit the program called exit({exit_.code!r}) before its tests finished\n")
        sys.stderr.flush()
        os._exit(5)
    except AssertionError:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)
    except MemoryError:
        sys.stderr.write("MemoryError\n")
        sys.stderr.flush()
        os._exit(4)
    except OSError as err:
        if err.errno == 27:  # EFBIG: past RLIMIT_FSIZE (Python ignores SIGXFSZ), its output included
            os._exit(6)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    verdict.write(nonce)
    verdict.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
