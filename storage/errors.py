"""Errors raised by `storage`; each message names the problem and what to do about it."""

from __future__ import annotations


class StorageError(Exception):
    """Base class of every storage error."""


class SchemaVersionError(StorageError):
    """A run or stage was written with another storage schema version."""


class CorruptChunkError(StorageError):
    """A chunk failed its crc32c check or is missing/truncated."""


class StageLockedError(StorageError):
    """Another live writer holds the stage (or table) lock."""


class NotPublishedError(StorageError):
    """A reader asked for a stage that has not been published."""


class AlreadyPublishedError(StorageError):
    """A writer tried to begin a stage that is already published (stages are immutable)."""


class IncompleteStageError(StorageError):
    """Publish was asked for a stage whose trajectories were not all written."""
