"""The errors of reading data (:mod:`dturbo.data.readers`)."""


class DataError(ValueError):
    """A dataset file is missing or malformed; the message names the file and the fix."""


class DataWarning(UserWarning):
    """A dataset loads but looks wrong (e.g. classes without training samples); the message says what to do."""
