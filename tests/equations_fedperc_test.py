"""FedPerC's algorithms held to its paper's update equations.

FedPerC (Silva, Tambwekar & Gombolay): a frozen GPT-2 whose learned parts are
a personal embedding psi (private) times a context embedding phi_c (shared),
prepended as a one-token prefix (Sec. 3.1), psi and phi_c predicted by
shared embedding generators instead (FedPerC (Generated): Sec. 3.2.1,
Algorithm 2, Appendix A), or the baselines' output heads (Sec. 4:
Split-Learning, a personal and a per-context head; Meta-Learning, one
shared unfrozen output layer). As `tests/equations_test.py`: two rounds,
three clients of 3, 2 and 4 utterances in batches of 2, SGD 0.1 on the
clients, SGD 0.7 at the server, DP off, every value to 1e-5 of a float64
NumPy reference written from the equations, and each reference's mutations.

The backbone is the library's own `GPT2Backbone` (through
`fedperc_backbone.BackboneSpec`), tiny and with no transformer layer: a
token and a position embedding and the final layer norm, so the whole
network, frozen part included, is a few lines of NumPy: with no layer,
output position t reads the input at t alone, h_t = LN(x_t + p_t), and the
logits are h_t E^T (GPT-2's tied output layer). The prefix then reaches the
loss through the first token's prediction only, through the layer norm (its
gradient is written out below); the heads' gradients are those of a linear
layer on the fixed features h. This keeps every learned part's update (the
algorithms' equations) exact; what the tiny backbone does not exercise is
the attention of later positions to the prefix, which is the frozen
backbone's (keras-nlp's), not an update equation.

The update equations (Algorithm 1, Eq. 1, and Appendix B): per sampled
batch B_d, one gradient step on theta_d (nothing: the backbone is frozen),
phi_d and psi_d of the batch's token-mean NLL plus FedProx's
mu/2 ||phi_d - phi||^2 on the shared parameters (mu = 1, Appendix B; the
private psi has no global value), all at the same point (Eq. 1); the
server averages the deltas phi - phi_d (lines 13-18) and applies them
(lines 19-20), here with its SGD step. Averaging: Algorithm 1 line 17
writes the plain mean 1/D sum_d, while Appendix B says training is
"a standard federated averaging training procedure (FedAvg) (McMahan et
al., 2017)", whose mean is weighted by the clients' examples; the library
weights by utterances (the reference does; the plain mean is a mutation
it would catch: with equal-sized clients the two agree).
"""

import collections
import types

import numpy as np
import pytest
import scipy.special
import tensorflow as tf
import tensorflow_federated as tff

from tests import equations_test as eqt
from tff_personal.algorithms import registry
from tff_personal.core import process as process_lib
from tff_personal.models import fedperc
from tff_personal.models import fedperc_backbone

VOCAB = 7
HIDDEN = 4
TOKENS = 4          # utterance length L (right-padded)
CONTEXTS = 2
LN_EPS = 1e-5       # GPT-2's layer-norm epsilon
MU = 1.0            # FedProx's mu (Appendix B)


def _spec() -> fedperc_backbone.BackboneSpec:
  """A GPT-2 of no transformer layer: token and position embeddings and
  the final layer norm, with fixed random weights."""
  rng = np.random.default_rng(5)
  weights = (rng.normal(size=(VOCAB, HIDDEN)),          # token embedding E
             rng.normal(size=(TOKENS + 2, HIDDEN)),     # positions P
             1.0 + 0.3 * rng.normal(size=HIDDEN),       # LN gamma
             0.2 * rng.normal(size=HIDDEN))             # LN beta
  return fedperc_backbone.BackboneSpec(
      config=dict(vocabulary_size=VOCAB, num_layers=0, num_heads=1,
                  hidden_dim=HIDDEN, intermediate_dim=HIDDEN, dropout=0.0,
                  max_sequence_length=TOKENS + 2),
      weights=tuple(w.astype(np.float32) for w in weights),
      vocabulary={f't{i}': i for i in range(VOCAB)}, merges=(), name='eq')


_SPEC = _spec()
_FROZEN = tuple(w.astype(np.float64) for w in _SPEC.weights)


def _factory(variant: str, seed: int = 0):
  return lambda: fedperc.FedPercModel(_SPEC, _config(variant), seed)


_TASK = types.SimpleNamespace(name='equations_fedperc',
                              fedperc_model_fn_factory=_factory)


# ------------------------------------------------------------ data


def _client_arrays(round_num: int):
  """Each client's utterances: ids, a right-padded mask (2 to 4 tokens),
  and each utterance's context (a user writes in both)."""
  rng = np.random.default_rng([13, round_num])
  out = []
  for n in eqt.SIZES:
    lengths = rng.integers(2, TOKENS + 1, n)
    mask = (np.arange(TOKENS)[None] < lengths[:, None]).astype(np.int32)
    ids = (rng.integers(0, VOCAB, (n, TOKENS)) * mask).astype(np.int32)
    context = rng.integers(0, CONTEXTS, n).astype(np.int32)
    out.append(dict(ids=ids, mask=mask, context=context))
  return out


def _datasets(round_num: int):
  return [tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
      (k, d[k]) for k in ('ids', 'mask', 'context'))).batch(eqt.BATCH)
          for d in _client_arrays(round_num)]


def _batches(d):
  return [{k: v[i:i + eqt.BATCH] for k, v in d.items()}
          for i in range(0, len(d['ids']), eqt.BATCH)]


# ------------------------------------------------------------ the network


def _layer_norm(x):
  gamma, beta = _FROZEN[2], _FROZEN[3]
  mean = x.mean(-1, keepdims=True)
  sigma = np.sqrt(x.var(-1, keepdims=True) + LN_EPS)
  xhat = (x - mean) / sigma
  return gamma * xhat + beta, (xhat, sigma)


def _layer_norm_backward(dy, cache):
  """d loss / d x of y = gamma (x - mean(x)) / sigma(x) + beta."""
  xhat, sigma = cache
  dxhat = dy * _FROZEN[2]
  return (dxhat - dxhat.mean(-1, keepdims=True)
          - xhat * (dxhat * xhat).mean(-1, keepdims=True)) / sigma


def _softmax_grad(logits, targets, tmask):
  """(token-mean NLL's gradient in the logits, the loss): the loss is the
  batch's NLL summed over its target tokens over their number."""
  count = max(tmask.sum(), 1.0)
  z = np.exp(logits - logits.max(-1, keepdims=True))
  p = z / z.sum(-1, keepdims=True)
  onehot = np.eye(VOCAB)[targets]
  loss = -(np.log((p * onehot).sum(-1)) * tmask).sum() / count
  return (p - onehot) * tmask[..., None] / count, loss


def lm_grads(p, batch, variant):
  """Gradients of the batch's token-mean NLL in the learned parameters.

  `embedding`: the prefix psi * phi_c (psi = 1 + offset, the library's
  parametrisation of psi), x = [prefix, E[ids]] + P, position t predicts
  token t. `split`: logits h (E^T + D_user + D_context(c)); `meta`:
  h (E^T + D); without a prefix position t predicts token t + 1.
  """
  emb, pos = _FROZEN[0], _FROZEN[1]
  ids, ctx = batch['ids'], batch['context']
  mask = batch['mask'].astype(np.float64)
  if variant == fedperc.EMBEDDING:
    psi = 1.0 + p['offset']
    prefix = psi[None] * p['phi'][ctx]
    x = np.concatenate([prefix[:, None], emb[ids]], 1) + pos[:TOKENS + 1]
    h, cache = _layer_norm(x)
    g, _ = _softmax_grad(h[:, :-1] @ emb.T, ids, mask)
    # Only position 0 (the prefix's) depends on psi and phi.
    dx0 = _layer_norm_backward(g[:, 0] @ emb, (cache[0][:, 0],
                                               cache[1][:, 0]))
    dphi = np.zeros_like(p['phi'])
    np.add.at(dphi, ctx, dx0 * psi[None])
    return {'phi': dphi, 'offset': (dx0 * p['phi'][ctx]).sum(0)}
  h, _ = _layer_norm(emb[ids] + pos[:TOKENS])
  h = h[:, :-1]
  if variant == fedperc.META:
    g, _ = _softmax_grad(h @ (emb.T + p['head']), ids[:, 1:], mask[:, 1:])
    return {'head': np.einsum('bth,btv->hv', h, g)}
  heads = emb.T[None] + p['personal_head'][None] + p['context_heads'][ctx]
  g, _ = _softmax_grad(np.einsum('bth,bhv->btv', h, heads), ids[:, 1:],
                       mask[:, 1:])
  per_example = np.einsum('bth,btv->bhv', h, g)
  dctx = np.zeros_like(p['context_heads'])
  np.add.at(dctx, ctx, per_example)
  return {'personal_head': per_example.sum(0), 'context_heads': dctx}


# ------------------------------------------------------------ the reference

# The learned parts of each variant: (shared, private).
PARTS = {fedperc.EMBEDDING: (('phi',), ('offset',)),
         fedperc.SPLIT: (('context_heads',), ('personal_head',)),
         fedperc.META: (('head',), ())}


def _parts(variant):
  """(shared, private) names of the variant's learned parts, the shared in
  the library's order."""
  if variant != fedperc.GENERATED:
    return PARTS[variant]
  with tf.Graph().as_default():
    model = _factory(variant)()
    names = tuple('phi' if v.name == 'context_embeddings:0' else
                  v.name.split(':')[0] for v in
                  model.shared_trainable_variables)
  return names, ('offset',)


def fedperc_reference(variant):
  """Algorithm 1 (Eq. 1 for the embeddings; the baselines' heads in place of
  phi and psi), FedProx on the shared parts (Appendix B), FedAvg's weighted
  mean and the server's SGD step."""
  shared_keys, private_keys = PARTS[variant]

  def reference(w0, private0, eq):
    w = dict(w0)
    mine = [dict(private0(c)) for c in range(len(eqt.SIZES))]
    trained = eq.get('trained', shared_keys + private_keys)
    for r in range(eqt.ROUNDS):
      locals_ = []
      for c, d in enumerate(_client_arrays(r)):
        p = {**w, **mine[c]}
        for batch in _batches(d):
          g = lm_grads(p, batch, variant)
          for k in shared_keys:  # FedProx toward the broadcast value
            g[k] = g[k] + eq['mu'] * (p[k] - w[k])
          p = {**p, **{k: p[k] - eq['eta'] * g[k] for k in trained}}
        locals_.append(p)
        mine[c] = {k: p[k] for k in private_keys}
      w = eqt.server_step(w, locals_, eq['weights'], shared_keys,
                          eq['eta_s'])
    return eqt.Outcome(server=w, server_fixed=dict(enumerate(_FROZEN)),
                       clients=mine)

  return reference


# ------------------------------------------------------------ generated
#
# FedPerC (Generated) (Sec. 3.2.1, Algorithm 2, Appendix A): psi and phi_c are
# predicted by two embedding generators, transformer decoder blocks run
# over an utterance's tokens; the generators (and the context embeddings
# they start from) are the trained, shared parameters. Their forward pass
# is Appendix A's equations below; its gradient is taken by central
# differences of that forward pass in float64 (every parameter perturbed
# at once, vectorized: error ~1e-9, far below the tolerance), the FedProx
# term's exactly.

GEN_HEADS = 2         # attention heads of each generator
GEN_UTTERANCES = 1    # per batch: the first generates, the others are scored
GEN_LN_EPS = 1e-3     # the generators' layer norms (Keras' default)
GENERATORS = ('personal_generator', 'context_generator')


def _config(variant):
  return fedperc.FedPercConfig(
      variant, num_contexts=CONTEXTS, max_tokens=TOKENS,
      context_init_stddev=0.5, generator_heads=GEN_HEADS,
      generator_utterances=GEN_UTTERANCES)


def _gelu(x):
  return 0.5 * x * (1.0 + scipy.special.erf(x / np.sqrt(2.0)))


def _ln_batched(x, gamma, beta, eps):
  """Layer norm of x [S, ..., H] with per-set gamma, beta [S, H]."""
  shape = (gamma.shape[0],) + (1,) * (x.ndim - 2) + (gamma.shape[-1],)
  mean = x.mean(-1, keepdims=True)
  xhat = (x - mean) / np.sqrt(x.var(-1, keepdims=True) + eps)
  return gamma.reshape(shape) * xhat + beta.reshape(shape)


def _generator(p, name, e, words, mask):
  """Appendix A, for each utterance from e_0 = `e` [S, N, H] over its
  tokens `words` [N, T, H] (future-masked: step t sees W_{<t}):
  e_t = MultiHeadAttn(query=LN(e_{t-1}), keys=values=W_{<t});
  e_t = LN(LN(e_t) + LN(e_{t-1})); e_t = LN(FFN(e_t) + LN(e_{t-1}));
  a padding token leaves e unchanged. Every parameter has a leading axis
  S (parameter sets evaluated together)."""
  g = lambda k: p[f'{name}/{k}']
  ln = lambda x, k: _ln_batched(x, g(f'{k}/gamma'), g(f'{k}/beta'),
                                GEN_LN_EPS)
  key_dim = HIDDEN // GEN_HEADS
  keys = np.einsum('nth,shkd->sntkd', words, g('attention/key/kernel')
                   ) + g('attention/key/bias')[:, None, None]
  values = np.einsum('nth,shkd->sntkd', words, g('attention/value/kernel')
                     ) + g('attention/value/bias')[:, None, None]
  positions = np.arange(words.shape[1])
  for t in range(1, words.shape[1] + 1):
    visible = mask.astype(bool) & (positions[None] < t)
    previous = ln(e, 'ln_previous')
    query = (np.einsum('snh,shkd->snkd', previous,
                       g('attention/query/kernel'))
             + g('attention/query/bias')[:, None]) / np.sqrt(key_dim)
    scores = np.einsum('sntkd,snkd->snkt', keys, query) + (
        1.0 - visible[None, :, None, :]) * -1e9
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    probs = scores / scores.sum(-1, keepdims=True)
    attended = np.einsum('snkd,skdh->snh', np.einsum(
        'snkt,sntkd->snkd', probs, values), g(
            'attention/attention_output/kernel')) + g(
                'attention/attention_output/bias')[:, None]
    x = ln(ln(attended, 'ln_attention') + previous, 'ln_middle')
    ffn = np.einsum('snf,sfh->snh', _gelu(
        np.einsum('snh,shf->snf', x, g('ffn_in/kernel'))
        + g('ffn_in/bias')[:, None]), g('ffn_out/kernel')) + g(
            'ffn_out/bias')[:, None]
    x = ln(ffn + previous, 'ln_output')
    e = np.where(mask[None, :, t - 1, None].astype(bool), x, e)
  return e


def generate(p, offset, batch):
  """Algorithm 2's generators on a batch's utterances: (psi - 1 [S, H],
  the context table [S, C, H]): psi is the mean over the utterances of the
  personal generator from the current psi; each context's phi_c the mean
  of the context generator from phi_c over its utterances (a context with
  none keeps its embedding)."""
  words = _FROZEN[0][batch['ids']]
  mask, ctx = batch['mask'], batch['context']
  n, sets = len(ctx), p['phi'].shape[0]
  psi = np.broadcast_to((1.0 + offset)[:, None], (sets, n, HIDDEN))
  personal = _generator(p, GENERATORS[0], psi, words, mask).mean(1)
  generated = _generator(p, GENERATORS[1], p['phi'][:, ctx], words, mask)
  table = p['phi'].copy()
  for c in range(CONTEXTS):
    if np.any(ctx == c):
      table[:, c] = generated[:, ctx == c].mean(1)
  return personal - 1.0, table


def generated_loss(p, offset, batch):
  """[S] the token-mean NLL of the batch's scored utterances under the
  prefix psi * phi_c generated from its first ones (Algorithm 2 lines 9-13;
  0 when the batch has no scored utterance)."""
  head = {k: v[:GEN_UTTERANCES] for k, v in batch.items()}
  target = {k: v[GEN_UTTERANCES:] for k, v in batch.items()}
  new_offset, table = generate(p, offset, head)
  if not len(target['ids']):
    return np.zeros(p['phi'].shape[0]), new_offset, table
  emb, pos = _FROZEN[0], _FROZEN[1]
  ids, mask = target['ids'], target['mask'].astype(np.float64)
  prefix = (1.0 + new_offset)[:, None] * table[:, target['context']]
  h0, _ = _layer_norm(prefix + pos[0])                     # [S, B, H]
  rest, _ = _layer_norm(emb[ids[:, :-1]] + pos[1:TOKENS])  # [B, L-1, H]
  logits0 = h0 @ emb.T
  logits = rest @ emb.T
  def token_nll(l, y):
    m = l.max(-1, keepdims=True)
    logp = l - m - np.log(np.exp(l - m).sum(-1, keepdims=True))
    y = np.broadcast_to(y, logp.shape[:-1])
    return -np.take_along_axis(logp, y[..., None], -1)[..., 0]
  total = (token_nll(logits0, ids[:, 0]) * mask[:, 0]).sum(-1) + (
      token_nll(logits, ids[:, 1:]) * mask[:, 1:]).sum()
  return total / max(mask.sum(), 1.0), new_offset, table


def _numeric_grad(p, offset, batch, keys, h=1e-6):
  """Central differences of `generated_loss` in every parameter of `keys`,
  all perturbations evaluated as one vectorized batch of parameter sets."""
  sizes = [p[k].size for k in keys]
  n = sum(sizes)
  steps = np.concatenate([np.eye(n), -np.eye(n)]) * h
  sets, start = {}, 0
  for k, size in zip(keys, sizes):
    delta = steps[:, start:start + size].reshape((2 * n,) + p[k].shape)
    sets[k] = p[k][None] + delta
    start += size
  loss, _, _ = generated_loss(
      sets, np.broadcast_to(offset, (2 * n, HIDDEN)), batch)
  flat = (loss[:n] - loss[n:]) / (2 * h)
  out, start = {}, 0
  for k, size in zip(keys, sizes):
    out[k] = flat[start:start + size].reshape(p[k].shape)
    start += size
  return out


def generated_reference(w0, private0, eq):
  """FedPerC (Generated), Algorithm 2: per batch, the generators step on the
  loss of the prefix they generate (lines 14-15) plus FedProx's
  mu/2 ||w - w_global||^2 (Appendix B), and psi_d <- Gamma_d(theta_d, psi_d,
  B_d) (line 13: the generated value, no gradient step); the server
  averages the shared parameters' deltas as FedPerC does.

  The context embeddings phi are the library's reading: the starting
  values of the context generator, trained by the same gradient step and
  averaged; the generated table is the prefix's only. Line 12 read
  literally overwrites phi_d with its generated value every step (as
  line 13 does psi_d), but lines 17-20 then return no phi delta while
  line 26 applies one: the algorithm does not say what phi's global
  update is. The literal local step is the mutation 'phi_d overwritten'.
  """
  keys = tuple(w0)
  w = dict(w0)
  offsets = [private0(c)['offset'] for c in range(len(eqt.SIZES))]
  for r in range(eqt.ROUNDS):
    locals_ = []
    for c, d in enumerate(_client_arrays(r)):
      p = dict(w)
      for batch in _batches(d):
        g = _numeric_grad(p, offsets[c], batch, keys)
        one = {k: v[None] for k, v in p.items()}
        _, new_offset, table = generated_loss(one, offsets[c][None], batch)
        for k in eq.get('trained') or [
            k for k in keys if k not in eq.get('frozen', ())]:
          p[k] = p[k] - eq['eta'] * (g[k] + eq['mu'] * (p[k] - w[k]))
        if eq['regenerate']:
          offsets[c] = new_offset[0]
        if eq['phi_generated']:  # Algorithm 2 line 12, read literally
          p['phi'] = table[0]
      locals_.append(p)
    w = eqt.server_step(w, locals_, eq['weights'], keys, eq['eta_s'])
  return eqt.Outcome(server=w, server_fixed=dict(enumerate(_FROZEN)),
                     clients=[{'offset': o} for o in offsets])


def _initial_private(seed: int):
  def init(k):
    rng = np.random.default_rng([seed, k])
    values = dict(offset=rng.normal(scale=0.5, size=HIDDEN),
                  personal_head=rng.normal(scale=0.5, size=(HIDDEN, VOCAB)))
    return {n: v.astype(np.float32).astype(np.float64)
            for n, v in values.items()}
  return init


def run_fedperc(name: str, variant: str, init_private, **options):
  """Two rounds of the registered FedPerC algorithm: (outcome, initial
  shared weights by name)."""
  shared_keys, private_keys = _parts(variant)
  proc = registry.build_for_task(
      name, _TASK,
      client_optimizer=tff.learning.optimizers.build_sgdm(eqt.ETA),
      server_optimizer=tff.learning.optimizers.build_sgdm(eqt.ETA_S),
      seed=3, **options)
  state = proc.initialize()
  name_of = lambda values: dict(zip(shared_keys, (
      np.asarray(v, np.float64) for v in values)))
  w0 = name_of(proc.get_model_weights(state).trainable)
  states = [collections.OrderedDict([
      (process_lib.CLIENT_STATE_PRIVATE,
       tuple(np.float32(init_private(k)[n]) for n in private_keys)),
      (process_lib.CLIENT_STATE_ROUNDS, np.int32(0))])
            for k in range(len(eqt.SIZES))]
  for r in range(eqt.ROUNDS):
    state, states, _ = proc.next(state, states, _datasets(r))
  weights = proc.get_model_weights(state)
  return eqt.Outcome(
      server=name_of(weights.trainable),
      server_fixed={i: np.asarray(v, np.float64)
                    for i, v in enumerate(weights.non_trainable)},
      clients=[dict(zip(private_keys, (
          np.asarray(v, np.float64)
          for v in s[process_lib.CLIENT_STATE_PRIVATE]))) for s in states]
  ), w0


_COMMON = {'client step doubled': {'eta': 2 * eqt.ETA},
           'server step 1': {'eta_s': 1.0},
           'clients weighted equally (Alg. 1 line 17)': {'weights': (1, 1, 1)},
           'no FedProx term': {'mu': 0.0}}

CASES = [
    eqt.Case('fedperc', fedperc_reference(fedperc.EMBEDDING),
             private=('offset',), options={'proximal_mu': MU},
             constants={'mu': MU},
             mutations={**_COMMON,
                        'psi not trained': {'trained': ('phi',)},
                        'phi not trained': {'trained': ('offset',)}}),
    # The same training; the two differ at test time only (no fine-tuning).
    eqt.Case('fedperc_frozen', fedperc_reference(fedperc.EMBEDDING),
             private=('offset',), options={'proximal_mu': MU},
             constants={'mu': MU},
             mutations={'FedProx mu doubled': {'mu': 2 * MU},
                        'psi not trained': {'trained': ('phi',)}}),
    eqt.Case('split_learning', fedperc_reference(fedperc.SPLIT),
             private=('personal_head',), options={'proximal_mu': MU},
             constants={'mu': MU},
             mutations={**_COMMON,
                        'personal head not trained': {
                            'trained': ('context_heads',)}}),
    eqt.Case('meta_learning', fedperc_reference(fedperc.META),
             options={'proximal_mu': MU}, constants={'mu': MU},
             mutations=_COMMON),
    eqt.Case('fedperc_generated', generated_reference,
             private=('offset',), options={'proximal_mu': MU},
             constants={'mu': MU, 'regenerate': True,
                        'phi_generated': False},
             mutations={**_COMMON,
                        'generators not trained': {'trained': ('phi',)},
                        'psi kept, not generated (line 13)': {
                            'regenerate': False},
                        'phi_d overwritten by its generated value (line 12 '
                        'literally)': {'phi_generated': True,
                                       'frozen': ('phi',)}}),
]
_VARIANTS = {'fedperc_generated': fedperc.GENERATED,
             'fedperc': fedperc.EMBEDDING, 'fedperc_frozen': fedperc.EMBEDDING,
             'split_learning': fedperc.SPLIT, 'meta_learning': fedperc.META}


def test_the_cases_are_the_ones_the_main_file_counts():
  assert {c.registered for c in CASES} == eqt.COVERED_ELSEWHERE[
      __name__.rsplit('.', 1)[-1]]


@pytest.mark.parametrize('case', CASES, ids=lambda c: c.name)
def test_round_follows_the_papers_equations(case):
  init = _initial_private(seed=11)
  got, w0 = run_fedperc(case.registered, _VARIANTS[case.name], init,
                        **case.options)
  want = case.reference(w0, init, eqt.constants(case))
  eqt.assert_close(got, want, case.name)
  assert case.mutations, case.name
  for what, change in case.mutations.items():
    mutated = case.reference(w0, init, eqt.constants(case, **change))
    assert eqt.differs(mutated, want), f'{case.name}: {what} is not detected'


def test_the_layer_norm_gradient_is_the_derivative():
  """The reference's one hand-written backward pass, against central
  differences of its own forward (float64)."""
  rng = np.random.default_rng(0)
  x, dy = rng.normal(size=(3, HIDDEN)), rng.normal(size=(3, HIDDEN))
  got = _layer_norm_backward(dy, _layer_norm(x)[1])
  e = 1e-6
  want = np.zeros_like(x)
  for i in np.ndindex(x.shape):
    step = np.zeros_like(x)
    step[i] = e
    want[i] = ((_layer_norm(x + step)[0] - _layer_norm(x - step)[0]) * dy
               ).sum() / (2 * e)
  np.testing.assert_allclose(got, want, atol=1e-7)
