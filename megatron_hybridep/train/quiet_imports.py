"""Imported first by the ranks' fork server (train/launch.py PRELOAD): installs runtime/logs.py's
filters for known-harmless warnings before torch and Megatron are imported there, since a preload
can only import modules. Nothing else imports it; everything else calls quiet_known_warnings()."""

from megatron_hybridep.runtime.logs import quiet_known_warnings

quiet_known_warnings()
