"""The conformance checks: one module per rule, each named after the rule it guards.

Collected by the ``attnplug_conformance`` pytest plugin when it is asked
(``--attnplug-backend``), or imported into a test file with
``from attnplug_conformance.suite import *``. Every check is parametrised over the backends
under test by the plugin and skips only from the backend's declared ``capabilities()``.
"""
