from attnplug_conformance.suite import *  # noqa: F401,F403  (the whole conformance suite)
