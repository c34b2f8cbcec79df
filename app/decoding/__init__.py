"""Per-token decisions: stops and their reasons, sampling and drafts, the guide's grammar and its matcher. The face
holds only the stop records (light: no torch)."""

from app.decoding.stops import Limit, Stop, StopReason

__all__ = ["Limit", "Stop", "StopReason"]
