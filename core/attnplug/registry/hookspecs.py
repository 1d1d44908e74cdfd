"""The plugin contract: one pluggy hook, ``attnplug_register_backends``.

A plugin is a module (or object) named by an entry point in the group ``attnplug.backends``::

    # the plugin's pyproject.toml
    [project.entry-points."attnplug.backends"]
    mydevice = "attnplug_mydevice.plugin"

    # attnplug_mydevice/plugin.py
    from attnplug import hookimpl

    PLUGIN_API_VERSION = "1.0"

    def _probe():
        ...  # find the device without initialising its runtime
        return True, "2 devices visible"

    @hookimpl
    def attnplug_register_backends(register):
        register(name="mydevice", backend="attnplug_mydevice.backend:MyDeviceBackend",
                 probe=_probe, priority=100)

Plugin authors may also build their own marker, ``pluggy.HookimplMarker("attnplug")``; it is the
same thing.
"""

from __future__ import annotations

import pluggy

__all__ = ["HOOK_NAME", "PLUGIN_API_VERSION", "PROJECT_NAME", "hookspec", "hookimpl", "AttnplugHookspecs"]

#: version of the plugin contract (``AttnplugHookspecs``); a plugin declares the version it was
#: written for and is skipped when the major differs
PLUGIN_API_VERSION = "1.0"

#: the pluggy project name shared by the hook specification and every implementation
PROJECT_NAME = "attnplug"

#: the one hook
HOOK_NAME = "attnplug_register_backends"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class AttnplugHookspecs:
    """The hook specifications of attnplug (one hook)."""

    @hookspec
    def attnplug_register_backends(self, register):
        """Register the attention backends this plugin provides.

        Called once per plugin, when the registry is first used (never at ``import attnplug``).
        Call ``register`` once per backend, with keyword arguments only::

            register(name="mydevice",
                     backend="attnplug_mydevice.backend:MyDeviceBackend",
                     probe=probe,
                     priority=100)

        ``name`` (str)
            The backend's registry name: what ``get_backend(name)``, ``ATTNPLUG_BACKEND`` and
            ``attnplug info`` use. The names of attnplug's own plugins (``reference`` and the
            entry-point names of the attnplug distribution) belong to it: another distribution's
            registration of one is refused and reported, whatever the loading order or the
            environment. A name registered by two other plugins is given to neither: both are
            reported and selecting the name fails with a reason naming both. A plugin that
            calls ``register`` twice with one name fails as a whole.
            By convention it equals the entry-point name, so that a plugin that fails to load
            can still be reported when the user asks for it by name.

        ``backend`` (str, ``"module:Class"``)
            Where the ``attnplug.backend.AttentionBackend`` subclass lives. It is imported
            only when the backend is selected (or listed as available), never at registration,
            so the plugin module itself stays importable on any machine. A target that fails
            to import or is not an ``AttentionBackend`` subclass makes the backend unavailable,
            with that reason. A third-party target is imported in the probe process first;
            only if that import returns a backend class within the time limit, without ending
            the process or leaving a thread running, is it imported in the caller's process.

        ``probe`` (callable, no arguments)
            Says whether the backend can run in this process. Returns either a
            ``attnplug.registry.ProbeResult(available, reason, device=None)`` or a tuple
            ``(available: bool, reason: str)``; ``reason`` says what was found or what is
            missing, in words a user can act on. The probe:

            * must not initialise a device runtime or create a device context (count
              devices, check versions, find modules; do not allocate or query properties that
              need a context);
            * may import vendor modules (lazily, inside the probe) and must be cheap: it runs
              for ``attnplug info`` and for automatic backend selection;
            * may raise: the exception (``SystemExit`` included) is caught and reported as the
              reason the backend is unavailable. It is run at most once per registry, under a
              time limit (``ATTNPLUG_PROBE_TIMEOUT`` seconds, default 5): a probe that takes
              longer makes the backend unavailable ("probe timed out after N s");
            * runs, for a plugin that is not part of the attnplug distribution, in the probe
              process: a child process that imports the plugin again, calls this hook again
              and then the probe, with the caller's ``os.environ`` and ``sys.path``. So it must
              not rely on state another part of the plugin set in the caller's process, and
              what it does to its process stays there: a probe that ends the process
              (``os._exit``, a crash) or leaves a non-daemon thread running makes the backend
              unavailable with that reason ("probe exited the process with code 3"), and its
              changes to ``os.environ``, torch's default dtype or random state are ignored and
              listed by ``attnplug info`` ("the probe changed os.environ X (ignored)").

        ``priority`` (int)
            Used only when no backend is named (neither ``get_backend(name)`` nor
            ``ATTNPLUG_BACKEND``): the available backend with the highest priority wins, and a
            tie at the top is an error naming the candidates. The reference backend is 0;
            accelerator plugins use 100.

        Versioning: the module that holds this hook implementation must declare
        ``PLUGIN_API_VERSION = "MAJOR.MINOR"`` (a string). A plugin whose major differs from
        ``attnplug.registry.PLUGIN_API_VERSION``, or that declares none, is skipped and listed
        with the reason; minor versions are compatible.

        Isolation: each plugin is loaded and called on its own, each step (its import, reading
        ``PLUGIN_API_VERSION``, this hook) in a worker thread under the time limit. If a step
        raises (anything, ``SystemExit`` and ``KeyboardInterrupt`` included: a signal reaches
        the caller's thread, not the plugin's) or outlives the limit, none of its registrations
        are kept, the error is recorded (``attnplug info`` shows it) and every other plugin
        loads normally. What a step changes in ``os.environ``, torch's default dtype or random
        state is undone and listed. A backend is an error only when the user selects it; the
        error carries the recorded reason. Plugin code (its import, this hook, a probe, the
        backend module's import, ``describe()``) must not call the registry
        (``attnplug.get_backend()``, ``available_backends()``, ...): such a call raises
        ``RegistryError``.

        The return value is ignored.
        """
