"""Graph loops of traced functions whose iterations could overlap."""

import tensorflow as tf

# Ops that read or write a resource variable (or call a function, checked
# through its body).
_CALLS = ('PartitionedCall', 'StatefulPartitionedCall')
_LOOPS = ('While', 'StatelessWhile')


def _touches_variables(name, library, seen) -> bool:
  if name in seen:
    return seen[name]
  seen[name] = False  # A recursive call adds nothing.
  found = False
  for node in library[name].node_def:
    if 'VariableOp' in node.op or node.op.startswith('Resource'):
      found = True
    for attr in node.attr.values():
      names = ([attr.func.name] if attr.HasField('func') else
               [f.name for f in attr.list.func])
      if any(n in library and _touches_variables(n, library, seen)
             for n in names):
        found = True
  seen[name] = found
  return found


def overlapping_variable_loops(function: tf.types.experimental.GenericFunction
                               ) -> list:
  """The graph loops of `function`'s traced programs that touch a resource
  variable in their body (transitively) and may run iterations at once
  (`parallel_iterations` above 1): their steps' variable reads and
  assignments are not ordered across iterations.

  Returns:
    `'<function>/<node> (parallel_iterations=N)'` for each such loop.
  """
  found = []
  for concrete in function._list_all_concrete_functions():  # pylint: disable=protected-access
    graph_def = concrete.graph.as_graph_def()
    library = {f.signature.name: f for f in graph_def.library.function}
    seen = {}
    for fn_name, nodes in [('<top>', graph_def.node)] + [
        (n, f.node_def) for n, f in library.items()]:
      for node in nodes:
        if node.op not in _LOOPS:
          continue
        parallel = node.attr['parallel_iterations'].i
        if parallel > 1 and _touches_variables(node.attr['body'].func.name,
                                               library, seen):
          found.append(f'{fn_name}/{node.name} '
                       f'(parallel_iterations={parallel})')
  return sorted(set(found))
