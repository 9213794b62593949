"""gridtrain explore: the strategy explorer, a local web page over the planner."""
