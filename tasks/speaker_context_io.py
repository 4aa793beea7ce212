"""Reads the TV-show and Shakespeare transcripts as (speaker, community, text).

Three sources, each in its own folder under a data root (the layout of
`../shared/data`):

  friends/friends.tsv.gz        TSV (CSV quoting: fields holding a `"` are
                                quoted, inner quotes doubled), header
                                `text speaker season episode scene utterance`.
  game_of_thrones/seasonN/eM.txt one line per turn, `SPEAKER: text`.
  shakespeare/shakespeare.tsv.gz TSV, header
                                `play title act scene speech speaker text`.

Every kept turn becomes an `Utterance(user, community, text)`:

* Friends: community 'friends', user 'friends/<NAME>'.
* Game of Thrones: community 'game_of_thrones', user 'got/<NAME>'.
* Shakespeare: community = the `play` column (e.g. 'hamlet'), user
  'shakespeare/<play>/<NAME>': the same name in two plays is two users.

Speaker names (all sources): whitespace is collapsed, typographic apostrophes
become ASCII, and names are upper-cased (Shakespeare has 'Clown' and 'CLOWN'
for one character in a play; 1,377 raw (play, speaker) pairs become 1,370).
Pseudo-speakers are dropped (`is_pseudo_speaker`):

* stage-direction and heading rows: Friends 'Scene Directions' and empty
  (multi-speaker) speakers; scene headings such as 'INT', 'EXT', 'INT. X',
  'CUT TO', 'CUT', 'TITLE SEQUENCE...', 'COLD OPEN', 'FADE ...', 'SCENE III',
  'ACT 2';
* multi-speaker turns: '#ALL#', names containing '&', '/', ',' or the word
  'AND', and names whose first word is ALL, BOTH, EVERYONE, EVERYBODY or
  TOGETHER (Shakespeare 'All Citizens', 'Both Tribunes', GoT 'ALL TOGETHER').

Game of Thrones lines:

* A line is a turn when the part before its first ':' looks like a name: after
  removing parentheticals ('JON (V.O.)', 'SEPTA MORDANE (to SANSA)') it has 1-4
  words, at most 40 characters, only letters, digits, spaces and `'.-#&/`, and
  every word starts with an upper-case letter, a digit or '#' (or is one of the
  particles of/the/and/zo/mo/maz/de/van/von). Anything else, bracketed lines
  and bare lines ('EXT. WOODS', 'Cersei takes her hands.') are stage directions
  and dropped, as are lines inside a '[...]' that spans several lines.
* Names: upper-cased; a leading 'THE ' is removed ('THE HOUND' -> 'HOUND');
  then a multi-word name N is mapped to its first word F when (1) F itself
  occurs as a one-word speaker name, (2) N is the only multi-word name
  starting with F, and (3) N looks like a personal name: no digit or '#'
  and no role/title word (`_ROLE_WORDS`: OF, MAN, GUARD, LORD, MAESTER,
  DWARF, ...). So 'JON SNOW' -> 'JON', 'Tyrion Lannister' -> 'TYRION'
  (44 names mapped on the real data), while 'SEPTA MORDANE'/'SEPTA UNELLA'
  and 'CERSEI BARATHEON'/'CERSEI LANNISTER' (two full names share F),
  'EDDARD STARK' (no speaker 'EDDARD'), 'PRISONER #2' (numbered role) and
  'MASTER OF ARMS' (role) keep their full names. Spelling variants
  ('CERSIE', 'NED' vs 'EDDARD STARK') are not merged.
* The four placeholder files (no script) give no turns and are skipped.

Friends names: upper-cased; a name is shortened to its first word F when F is
purely alphabetic, not a title or article (`_NOT_A_FIRST_NAME`), and no other
Friends speaker name has F as its first word ('Monica Geller' -> 'MONICA';
'Steve Cera', 'Steve' and 'Steve (drug addict)' all stay as they are). This is
injective: it only renames, never merges two speakers.

Texts (all sources): '[...]' and '(...)' spans (inline stage directions such as
'(to Ross)' or '[Within]') are removed; typographic quotes, dashes, ellipses and
non-breaking spaces become ASCII (Game of Thrones uses curly quotes, the other
two straight ones, which would otherwise give the community away); whitespace
is collapsed; empty texts are dropped.

Counts on the real data (as read by this module): Friends 60,657 utterances by
695 users (the 60,676 rows with one named speaker minus 19 by 'Both' and
'Together'); Game of Thrones 23,824 utterances by 631 users (684 distinct
names before the full-name mapping); Shakespeare 30,746 speeches by 1,326 users
in 37 plays (1,377 raw (play, speaker) pairs, 1,370 once upper-cased; 130
speeches by 'All', 'Both', 'Scene III', ... dropped).

Missing or malformed files raise `SpeakerDataError` (a `ValueError`) naming the
file and what is wrong.
"""

from __future__ import annotations

import collections
import csv
import gzip
import io
import os
import re
from typing import Iterable, NamedTuple
import zlib

FRIENDS = 'friends'
GAME_OF_THRONES = 'game_of_thrones'
SHAKESPEARE = 'shakespeare'

FRIENDS_FILE = os.path.join('friends', 'friends.tsv.gz')
SHAKESPEARE_FILE = os.path.join('shakespeare', 'shakespeare.tsv.gz')
GOT_DIR = 'game_of_thrones'

FRIENDS_COLUMNS = ('text', 'speaker', 'season', 'episode', 'scene',
                   'utterance')
SHAKESPEARE_COLUMNS = ('play', 'title', 'act', 'scene', 'speech', 'speaker',
                       'text')

# User-id prefixes, by source.
FRIENDS_PREFIX = 'friends/'
GOT_PREFIX = 'got/'
SHAKESPEARE_PREFIX = 'shakespeare/'


class SpeakerDataError(ValueError):
  """Transcript data is missing, unreadable or malformed."""


class Utterance(NamedTuple):
  """One turn: who said it, in which community, and what was said."""
  user: str
  community: str
  text: str


# Speaker names (upper-cased) that are never a single person.
_PSEUDO_NAMES = frozenset({'SCENE DIRECTIONS', '#ALL#', 'NA', 'N/A'})
_GROUP_FIRST_WORDS = frozenset(
    {'ALL', 'BOTH', 'EVERYONE', 'EVERYBODY', 'TOGETHER'})
_HEADING_RE = re.compile(
    r"""^(?:
      (?:INT|EXT|I/E)(?:\b|\.).*          # INT. ROOM, EXT, INT./EXT. CAMP
      | .*\bCUT\s+TO\b.*                  # CUT TO, TITLE SEQUENCECUT TO
      | CUT | SMASH\ CUT.* | FADE\b.* | DISSOLVE\b.*
      | TITLE\ SEQUENCE.* | COLD\ OPEN.* | OPENING\ CREDITS.*
      | END\ CREDITS.* | BLACKOUT.* | FLASHBACK.*
      | (?:SCENE|ACT)(?:\s+[IVXLC\d]+\b.*)?  # SCENE, SCENE III, ACT 2
    )$""", re.VERBOSE)
_MULTI_SPEAKER_RE = re.compile(r'[&/,]|\bAND\b')

# Typography -> ASCII, applied to texts and names.
_TYPOGRAPHY = str.maketrans({
    '\u2018': "'", '\u2019': "'", '\u201a': "'", '\u201b': "'",
    '\u2032': "'", '\u00b4': "'", '`': "'",
    '\u201c': '"', '\u201d': '"', '\u201e': '"', '\u201f': '"',
    '\u00ab': '"', '\u00bb': '"',
    '\u2010': '-', '\u2011': '-', '\u2012': '-', '\u2013': '-',
    '\u2014': '-', '\u2015': '-', '\u2212': '-',
    '\u2026': '...',
    '\u00a0': ' ', '\u2009': ' ', '\u200a': ' ', '\u202f': ' ',
    '\u200b': '', '\ufeff': '',
})
_BRACKETED_RE = re.compile(r'\[[^\[\]]*\]|\([^()]*\)')
_WHITESPACE_RE = re.compile(r'\s+')

# GoT speaker names: allowed characters and lower-case particles.
_NAME_CHARS_RE = re.compile(r"^[^\W_][\w '.#&/-]*$")
_NAME_PARTICLES = frozenset({'of', 'the', 'and', 'zo', 'mo', 'maz', 'de',
                             'van', 'von'})
_MAX_NAME_WORDS = 4
_MAX_NAME_CHARS = 40

# Words of GoT names that make a multi-word name a role or title, not
# 'FIRST SURNAME': such a name is never shortened to its first word.
_ROLE_WORDS = frozenset({
    'OF', 'THE', 'AND', 'MAN', 'MEN', 'WOMAN', 'WOMEN', 'BOY', 'GIRL',
    'CHILD', 'GUARD', 'SOLDIER', 'KNIGHT', 'CAPTAIN', 'LORD', 'LADY', 'SER',
    'KING', 'QUEEN', 'PRINCE', 'PRINCESS', 'KHAL', 'MAESTER', 'SEPTA',
    'SEPTON', 'PRIEST', 'PRIESTESS', 'MASTER', 'HEAD', 'PRISONER', 'STEWARD',
    'SERVANT', 'PROSTITUTE', 'WHORE', 'DWARF', 'IRONBORN', 'YOUNG', 'OLD',
    'LITTLE', 'HIGH', 'GRAND', 'BROTHER', 'SISTER', 'MOTHER', 'FATHER',
    'VOICE', 'LEADER', 'MERCHANT', 'SLAVE',
})

# First words that are titles or articles, not first names (Friends).
_NOT_A_FIRST_NAME = frozenset({
    'THE', 'A', 'AN', 'ANOTHER', 'MR', 'MRS', 'MS', 'MISS', 'DR', 'SIR',
    'AUNT', 'UNCLE', 'GRANDMA', 'GRANDPA', 'NURSE', 'DOCTOR', 'PROFESSOR',
    'CAPTAIN', 'OFFICER', 'FATHER', 'MOTHER', 'SISTER', 'BROTHER', 'YOUNG',
    'OLD', 'LITTLE', 'BIG', 'MALE', 'FEMALE', 'FIRST', 'SECOND', 'THIRD',
})


def normalize_whitespace(text: str) -> str:
  """Collapses runs of whitespace to one space and strips the ends."""
  return _WHITESPACE_RE.sub(' ', text).strip()


def clean_text(text: str) -> str:
  """Removes '[...]'/'(...)' spans, ASCII-fies typography, collapses spaces."""
  text = text.translate(_TYPOGRAPHY)
  previous = None
  while previous != text:  # Innermost spans first, so nesting is handled.
    previous = text
    text = _BRACKETED_RE.sub(' ', text)
  return normalize_whitespace(text)


def normalize_name(name: str) -> str:
  """Upper-cases a speaker name, ASCII-fies quotes and collapses spaces."""
  return normalize_whitespace(name.translate(_TYPOGRAPHY)).upper()


def is_pseudo_speaker(name: str) -> bool:
  """Whether a normalised (upper-case) name is not one person's.

  Args:
    name: A name as returned by `normalize_name`.

  Returns:
    True for empty names, stage-direction rows, scene headings and
    multi-speaker turns (see the module docstring).
  """
  if not name or name in _PSEUDO_NAMES:
    return True
  if _HEADING_RE.match(name) or _MULTI_SPEAKER_RE.search(name):
    return True
  return name.split(' ', 1)[0] in _GROUP_FIRST_WORDS


# Reading files.


def _read_gzip_text(path: str) -> str:
  """Returns the UTF-8 text of a gzip file, or raises SpeakerDataError."""
  if not os.path.isfile(path):
    raise SpeakerDataError(f'Data file {path} not found.')
  try:
    with open(path, 'rb') as f:
      raw = f.read()
  except OSError as e:
    raise SpeakerDataError(f'Cannot read data file {path}: {e}') from e
  try:
    data = gzip.decompress(raw)
  except (OSError, EOFError, zlib.error) as e:
    raise SpeakerDataError(
        f'Data file {path} is not a readable gzip file '
        f'({type(e).__name__}: {e}).') from e
  try:
    return data.decode('utf-8')
  except UnicodeDecodeError as e:
    raise SpeakerDataError(
        f'Data file {path} is not UTF-8 text ({e}).') from e


def read_tsv(path: str, columns: tuple[str, ...]
              ) -> Iterable[dict[str, str]]:
  """Yields the rows of a gzipped TSV as dicts of the `columns` wanted.

  Args:
    path: The `.tsv.gz` file.
    columns: Columns that must be in the header; other columns are ignored.

  Yields:
    One dict per data row, mapping each of `columns` to its field.

  Raises:
    SpeakerDataError: Missing file, bad gzip, empty file, a column missing
      from the header, or a row with the wrong number of fields.
  """
  text = _read_gzip_text(path)
  reader = csv.reader(io.StringIO(text, newline=''), delimiter='\t')
  try:
    header = next(reader)
  except StopIteration:
    raise SpeakerDataError(f'Data file {path} is empty (no header).') from None
  except csv.Error as e:
    raise SpeakerDataError(f'Data file {path}: bad header ({e}).') from e
  header = [h.strip() for h in header]
  missing = [c for c in columns if c not in header]
  if missing:
    raise SpeakerDataError(
        f'Data file {path} lacks column(s) {missing}; its header is {header}, '
        f'expected columns {list(columns)}.')
  index = [header.index(c) for c in columns]
  try:
    for row in reader:
      if not row:
        continue
      if len(row) != len(header):
        raise SpeakerDataError(
            f'Data file {path}, line {reader.line_num}: {len(row)} fields, '
            f'expected {len(header)} (columns {header}).')
      yield {c: row[i] for c, i in zip(columns, index)}
  except csv.Error as e:
    raise SpeakerDataError(
        f'Data file {path}, line {reader.line_num}: malformed TSV '
        f'({e}).') from e


def _require_some(utterances: list[Utterance], path: str) -> list[Utterance]:
  if not utterances:
    raise SpeakerDataError(
        f'{path} has no usable lines (no utterance by a named speaker with '
        'non-empty text).')
  return utterances


# Friends.


def _friends_short_names(names: Iterable[str]) -> dict[str, str]:
  """Maps each name to its first word when that is unambiguous (see module)."""
  names = set(names)
  by_first = collections.Counter(n.split(' ', 1)[0] for n in names)
  short = {}
  for name in names:
    first = name.split(' ', 1)[0]
    if (' ' in name and first.isalpha() and first not in _NOT_A_FIRST_NAME
        and by_first[first] == 1):
      short[name] = first
    else:
      short[name] = name
  return short


def load_friends(data_dir: str) -> list[Utterance]:
  """Loads the Friends utterances of single named speakers.

  Args:
    data_dir: The `friends` folder, holding `friends.tsv.gz`.

  Returns:
    Utterances in file order, community 'friends', users 'friends/<NAME>'.

  Raises:
    SpeakerDataError: The file is missing or malformed, or has no usable row.
  """
  path = os.path.join(data_dir, 'friends.tsv.gz')
  rows = []
  for row in read_tsv(path, ('text', 'speaker')):
    name = normalize_name(row['speaker'])
    if is_pseudo_speaker(name):
      continue
    text = clean_text(row['text'])
    if text:
      rows.append((name, text))
  short = _friends_short_names(name for name, _ in rows)
  return _require_some(
      [Utterance(FRIENDS_PREFIX + short[name], FRIENDS, text)
       for name, text in rows], path)


# Game of Thrones.


def parse_got_speaker(prefix: str) -> str | None:
  """Returns the normalised speaker name of a 'NAME: text' prefix, or None.

  Args:
    prefix: The part of a line before its first ':'.

  Returns:
    The upper-cased name (parentheticals and a leading 'THE ' removed), or
    None when the prefix does not look like a name or is a pseudo-speaker.
  """
  name = prefix.translate(_TYPOGRAPHY)
  name = re.sub(r'\([^()]*\)?', ' ', name)  # 'JON (V.O.)', 'DAVOS(to JON'
  name = normalize_whitespace(name).strip('-*.\u2022 ')
  words = name.split(' ')
  if (not name or len(name) > _MAX_NAME_CHARS or len(words) > _MAX_NAME_WORDS
      or not _NAME_CHARS_RE.match(name)):
    return None
  for word in words:
    if not (word[0].isupper() or word[0].isdigit() or word[0] == '#'
            or word in _NAME_PARTICLES):
      return None
  name = name.upper()
  if is_pseudo_speaker(name):
    return None
  if name.startswith('THE '):
    name = name[4:]
  return name


def got_turns(text: str) -> Iterable[tuple[str, str]]:
  """Yields the turns of one episode's script.

  Args:
    text: The whole script.

  Yields:
    `(speaker, raw text)`: the speaker as `parse_got_speaker` returns it
    (before the full-name mapping of `got_name_map`), the text uncleaned.
  """
  in_bracket = False
  for line in text.splitlines():
    line = line.strip()
    if in_bracket:
      close = line.find(']')
      colon = line.find(':')
      if close >= 0:  # The direction ends on this line.
        line = line[close + 1:].strip()
        in_bracket = False
      elif (colon > 0 and '[' not in line[:colon]
            and parse_got_speaker(line[:colon]) is not None):
        in_bracket = False  # A '[' that is never closed: resynchronise.
      else:
        continue
    if not line:
      continue
    # A '[' left open on this line swallows the following lines up to ']'.
    depth = 0
    for ch in line:
      if ch == '[':
        depth += 1
      elif ch == ']' and depth:
        depth -= 1
    if depth:
      in_bracket = True
      line = line[:line.rfind('[')]
    colon = line.find(':')
    if colon <= 0 or '[' in line[:colon]:
      continue
    speaker = parse_got_speaker(line[:colon])
    if speaker is not None:
      yield speaker, line[colon + 1:]


def got_name_map(names: Iterable[str]) -> dict[str, str]:
  """Maps full names to their first word where unambiguous (module docstring).

  Args:
    names: Normalised speaker names.

  Returns:
    A dict from every name to its canonical form.
  """
  names = set(names)
  singles = {n for n in names if ' ' not in n}
  multi_by_first = collections.defaultdict(list)
  for n in names:
    if ' ' in n:
      multi_by_first[n.split(' ', 1)[0]].append(n)
  mapping = {n: n for n in names}
  for first, full in multi_by_first.items():
    if first in singles and len(full) == 1 and _is_personal_name(full[0]):
      mapping[full[0]] = first
  return mapping


def _is_personal_name(name: str) -> bool:
  """Whether a multi-word name looks like 'FIRST SURNAME', not a role."""
  words = name.split(' ')
  return (not any(w in _ROLE_WORDS for w in words)
          and not any(ch.isdigit() or ch == '#' for ch in name))


def _episode_key(path: str) -> tuple[int, int, str]:
  season = re.search(r'season(\d+)', os.path.basename(os.path.dirname(path)))
  episode = re.search(r'e(\d+)\.txt$', os.path.basename(path))
  return (int(season.group(1)) if season else 0,
          int(episode.group(1)) if episode else 0, path)


def got_episode_files(data_dir: str) -> list[str]:
  """The `seasonN/eM.txt` files under `data_dir`, in season/episode order."""
  if not os.path.isdir(data_dir):
    raise SpeakerDataError(
        f'Game of Thrones folder {data_dir} not found (expected '
        'seasonN/eM.txt files in it).')
  files = []
  for season in os.listdir(data_dir):
    season_dir = os.path.join(data_dir, season)
    if not (re.fullmatch(r'season\d+', season) and os.path.isdir(season_dir)):
      continue
    files.extend(os.path.join(season_dir, f) for f in os.listdir(season_dir)
                 if re.fullmatch(r'e\d+\.txt', f))
  if not files:
    raise SpeakerDataError(
        f'Game of Thrones folder {data_dir} holds no seasonN/eM.txt files.')
  return sorted(files, key=_episode_key)


def load_game_of_thrones(data_dir: str) -> list[Utterance]:
  """Loads the Game of Thrones turns (episodes in order).

  Args:
    data_dir: The `game_of_thrones` folder, holding `seasonN/eM.txt`.

  Returns:
    Utterances, community 'game_of_thrones', users 'got/<NAME>' with the
    name normalisation of the module docstring.

  Raises:
    SpeakerDataError: The folder or its episode files are missing, a file is
      unreadable or not UTF-8, or no file has a usable line.
  """
  turns = []
  for path in got_episode_files(data_dir):
    try:
      with open(path, encoding='utf-8') as f:
        script = f.read()
    except (OSError, UnicodeDecodeError) as e:
      raise SpeakerDataError(
          f'Cannot read Game of Thrones script {path}: {e}') from e
    for speaker, raw in got_turns(script):
      text = clean_text(raw)
      if text:
        turns.append((speaker, text))
  mapping = got_name_map(name for name, _ in turns)
  return _require_some(
      [Utterance(GOT_PREFIX + mapping[name], GAME_OF_THRONES, text)
       for name, text in turns], os.path.join(data_dir, 'season*/e*.txt'))


# Shakespeare.


def load_shakespeare(data_dir: str) -> list[Utterance]:
  """Loads the Shakespeare speeches; a user is a (play, speaker) pair.

  Args:
    data_dir: The `shakespeare` folder, holding `shakespeare.tsv.gz`.

  Returns:
    Utterances, community = the play id, users 'shakespeare/<play>/<NAME>'.

  Raises:
    SpeakerDataError: The file is missing or malformed, a row has an empty
      play, or no row is usable.
  """
  path = os.path.join(data_dir, 'shakespeare.tsv.gz')
  out = []
  for i, row in enumerate(read_tsv(path, ('play', 'speaker', 'text'))):
    play = row['play'].strip()
    if not play or '/' in play:
      raise SpeakerDataError(
          f'Data file {path}, data row {i + 1}: bad play id {play!r}.')
    name = normalize_name(row['speaker'])
    if is_pseudo_speaker(name):
      continue
    text = clean_text(row['text'])
    if text:
      out.append(Utterance(f'{SHAKESPEARE_PREFIX}{play}/{name}', play, text))
  return _require_some(out, path)


def load_all(data_root: str) -> list[Utterance]:
  """Loads Friends, Game of Thrones and Shakespeare from one data root.

  Args:
    data_root: The folder holding the three source folders.

  Returns:
    Friends, then Game of Thrones, then Shakespeare utterances.

  Raises:
    SpeakerDataError: Any source is missing or malformed.
  """
  data_root = os.path.expanduser(data_root)
  if not os.path.isdir(data_root):
    raise SpeakerDataError(
        f'Data root {data_root} not found (expected friends/, '
        'game_of_thrones/ and shakespeare/ in it).')
  return (load_friends(os.path.join(data_root, 'friends'))
          + load_game_of_thrones(os.path.join(data_root, GOT_DIR))
          + load_shakespeare(os.path.join(data_root, 'shakespeare')))
