"""The training loops, in floors that import only downwards: `phases` (a `Job` and the phases of one step) below
`sync` (the synchronous loop), `asynchronous` (the asynchronous loop) and `recovery` (resume, recover from a dead
role), which import nothing from each other; `distrl.driver` above them picks one.
"""
