"""`gridtrain plan`, the command: its inputs (--layout, counts), the report it builds from the
planner's formulas (gridtrain.plan), and the text it prints (render, explain)."""
