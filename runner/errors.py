"""The one exception type for bad user input.

Anything raised as UserError is printed by the CLI as one line on stderr and the
process exits with code 2. Its message must say what is wrong and how to fix it.
"""


class UserError(Exception):
    """Bad configuration, missing data, unreadable checkpoint, unwritable output."""


EXIT_USER_ERROR = 2
