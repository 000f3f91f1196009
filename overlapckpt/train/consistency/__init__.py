"""One version per snapshot: replay's gradient log, stage mode's device area, the iteration boundary, the window choice."""
