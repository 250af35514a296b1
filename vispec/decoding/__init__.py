"""Model-agnostic decoders for visual AR models: AR, SJD and MC-SJD."""
