"""The version, in one place: the package, the CLI, pack's manifests and the build read it here."""

__version__ = "0.1.0"
