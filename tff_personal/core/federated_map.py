"""Broadcast-and-map: the federated wiring of client-side computations.

Personalized evaluation, local personalization and per-client updates all
share one federated pattern: the model weights are broadcast from the server
(or are already each client's own) and a client computation is mapped over
the weights and the clients' values, with the results left at CLIENTS:

    (<weights=W@SERVER, name_1={V_1}@CLIENTS, ...>
      -> {client_fn(W, V_1, ...)}@CLIENTS)

`broadcast_map` builds that `tff.federated_computation` from the client
computation, so it is written once.
"""

from __future__ import annotations

import tensorflow_federated as tff

WEIGHTS_NAME = 'weights'


def broadcast_map(
    client_fn: tff.Computation,
    weights_type: tff.Type,
    *client_types: tuple[str, tff.Type],
    weights_placement: tff.framework.PlacementLiteral = tff.SERVER,
) -> tff.Computation:
  """`(weights, *values@CLIENTS) -> {client_fn(weights, *values)}@CLIENTS`.

  The computation's parameter is named: `weights` first, then the client
  values under the given names, in order. With `weights_placement=tff.SERVER`
  the weights are broadcast to the clients (`tff.federated_broadcast`); with
  `tff.CLIENTS` each client's own weights are used as they are. Then
  `client_fn` is applied at each client (`tff.federated_map`) to
  `(weights, *values)`. Nothing is aggregated: the results stay at CLIENTS.

  Args:
    client_fn: a TFF computation taking `(weights, *values)` (unplaced).
    weights_type: the unplaced type of the weights.
    *client_types: one `(name, unplaced type)` pair per client value (at
      least one), in the order `client_fn` takes them after the weights.
    weights_placement: `tff.SERVER` (broadcast) or `tff.CLIENTS`.

  Returns:
    The `tff.federated_computation`, callable as
    `comp(weights, values_1, ...)` with one list entry per client for each
    client value.

  Raises:
    ValueError: if there is no client value, `weights_placement` is neither
      `tff.SERVER` nor `tff.CLIENTS`, or a name is used twice (`weights`
      included).
  """
  if not client_types:
    raise ValueError('broadcast_map needs at least one client value')
  if weights_placement not in (tff.SERVER, tff.CLIENTS):
    raise ValueError('weights_placement must be tff.SERVER or tff.CLIENTS, '
                     f'got {weights_placement}')
  names = [WEIGHTS_NAME] + [name for name, _ in client_types]
  if len(set(names)) != len(names):
    raise ValueError(f'parameter names must be distinct, got {names}')
  parameter_type = tff.StructType(
      [(WEIGHTS_NAME, tff.FederatedType(weights_type, weights_placement))] +
      [(name, tff.FederatedType(value_type, tff.CLIENTS))
       for name, value_type in client_types])

  @tff.federated_computation(parameter_type)
  def broadcast_and_map(arg):
    weights = arg[WEIGHTS_NAME]
    if weights_placement == tff.SERVER:
      weights = tff.federated_broadcast(weights)
    values = tuple(arg[name] for name, _ in client_types)
    return tff.federated_map(client_fn, (weights,) + values)

  return broadcast_and_map
