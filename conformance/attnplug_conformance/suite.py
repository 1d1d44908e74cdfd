"""The whole conformance suite as importable test functions: the one-line adoption.

A third-party plugin runs the suite against its backend with a test file holding::

    from attnplug_conformance.suite import *  # noqa: F401,F403

The ``attnplug_conformance`` pytest plugin (installed with attnplug, loaded automatically)
parametrises every check over the backends named by ``--attnplug-backend`` (or the ini
option ``attnplug_backends``; default: every available registered backend).
"""

from .checks.check_accepts_seq_lens_cpu_none import check_accepts_seq_lens_cpu_none
from .checks.check_attention_matches_reference import check_attention_matches_reference
from .checks.check_capabilities_honest import check_capabilities_honest
from .checks.check_kv_written_only_at_step_slots import check_kv_written_only_at_step_slots
from .checks.check_pdl_on_off_identical import check_pdl_on_off_identical
from .checks.check_replay_equals_eager import check_replay_equals_eager
from .checks.check_replay_metadata_sync_free import check_replay_metadata_sync_free
from .checks.check_swa_buffer_contract import check_swa_buffer_contract
from .checks.check_translates_once_per_step import check_translates_once_per_step

__all__ = [
    "check_accepts_seq_lens_cpu_none",
    "check_attention_matches_reference",
    "check_capabilities_honest",
    "check_kv_written_only_at_step_slots",
    "check_pdl_on_off_identical",
    "check_replay_equals_eager",
    "check_replay_metadata_sync_free",
    "check_swa_buffer_contract",
    "check_translates_once_per_step",
]
