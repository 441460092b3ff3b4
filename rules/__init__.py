"""The pure rules the workflows apply — planner, lifecycle, autoscaler, admission, changes, addresses, jobs,
idle, routers — and the names the workflows and activities share. Plain functions of models: no Temporal, no I/O,
so activities and the CLI use them without reaching up into the workflows."""
