"""Tests for tasks.speaker_context_io."""

import collections
import csv
import gzip
import io
import os

import pytest

from tasks import speaker_context_io as sio

DATA_ROOT = os.environ.get(
    'TFF_PERSONAL_DATA_ROOT',
    os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..',
                                 'shared', 'data')))


def _tsv_gz(path, header, rows):
  """Writes a gzipped TSV the way the real files are written (CSV quoting)."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  buf = io.StringIO()
  writer = csv.writer(buf, delimiter='\t', lineterminator='\n')
  writer.writerow(header)
  writer.writerows(rows)
  with gzip.open(path, 'wt', encoding='utf-8', newline='') as f:
    f.write(buf.getvalue())
  return path


def _write(path, text):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    f.write(text)
  return path


def _friends_row(text, speaker):
  return [text, speaker, '1', '1', '1', '1']


FRIENDS_ROWS = [
    _friends_row("There's nothing to tell!", 'Monica Geller'),
    _friends_row('(They all stare, bemused.)', 'Scene Directions'),
    _friends_row('Oh, yeah. Had that dream.', '#ALL#'),
    _friends_row('Push her down the stairs!', ''),
    _friends_row('Hi!', 'Both'),
    _friends_row('(to Ross)   Hey,\tyou "guys".', 'Monica Geller'),
    _friends_row('(sits down)', 'Monica Geller'),  # Empty once cleaned.
    _friends_row('I am Steve.', 'Steve'),
    _friends_row('I am Steve Cera.', 'Steve Cera'),
    _friends_row('Dr. Long here.', 'Dr. Long'),
    _friends_row('Joey here.', 'Joey Tribbiani'),
    _friends_row("Joey's date.", "Joey's Date"),
]


def _friends_dir(tmp_path, rows=FRIENDS_ROWS):
  d = os.path.join(tmp_path, 'friends')
  _tsv_gz(os.path.join(d, 'friends.tsv.gz'), list(sio.FRIENDS_COLUMNS), rows)
  return d


GOT_S1 = """\
[First scene opens with three Rangers riding through a tunnel.]
Jon Snow: Go on. Father\u2019s watching.
TITLE SEQUENCE[Riders come up behind WILL.]
EXT. WOODS
Cersei takes her hands.
SEPTA MORDANE (to SANSA): Fine work, as always.
SEPTA UNELLA: Confess.
SEPTA: Quiet.
CUT TO: INT. CASTLE
INT: The great hall.
[As he speaks, a CREATURE rises. WILL turns and runs.
GARED: I am inside a multi-line direction.]
ROBB STARK: Winter is coming. [He smiles.] (quietly) Truly.
Eddard Stark: I am Ned.
THE HOUND: Dogs.
PRISONER: Let me go.
PRISONER #2: Me too.
ALL: Hail!
JON/ROBB: Both of us.
Tell me something: this is not a speaker.
"""

GOT_S2 = """\
JON: I know nothing.
ROBB: King in the North.
KHAL DROGO: Blood.
KHAL MORO: Horses.
KHAL: Riders.
HOUND: Chicken.
"""


def _got_dir(tmp_path, scripts=None):
  d = os.path.join(tmp_path, 'game_of_thrones')
  if scripts is None:
    scripts = {'season1/e1.txt': GOT_S1, 'season2/e1.txt': GOT_S2,
               'season2/e11.txt': ''}  # A placeholder.
  for name, text in scripts.items():
    _write(os.path.join(d, name), text)
  return d


SHAKESPEARE_ROWS = [
    ['hamlet', 'Hamlet', '1', '1', '1', 'HAMLET', 'To be, or not to be.'],
    ['hamlet', 'Hamlet', '1', '1', '2', 'Gentleman', '[Aside]  My lord.'],
    ['hamlet', 'Hamlet', '1', '1', '3', 'Clown', 'A grave.'],
    ['hamlet', 'Hamlet', '1', '1', '4', 'CLOWN', 'Another grave.'],
    ['hamlet', 'Hamlet', '1', '1', '5', 'All', 'Long live the king!'],
    ['lear', 'King Lear', '1', '1', '1', 'Gentleman', 'Sir, the king.'],
    ['lear', 'King Lear', '1', '1', '2', 'Scene III', 'A heading.'],
    ['lear', 'King Lear', '1', '1', '3', 'Both Murderers', 'We will.'],
]


def _shakespeare_dir(tmp_path, rows=SHAKESPEARE_ROWS,
                     header=sio.SHAKESPEARE_COLUMNS):
  d = os.path.join(tmp_path, 'shakespeare')
  _tsv_gz(os.path.join(d, 'shakespeare.tsv.gz'), list(header), rows)
  return d


# Friends.


def test_friends_drops_pseudo_speakers_and_cleans_text(tmp_path):
  got = sio.load_friends(_friends_dir(tmp_path))
  assert got == [
      sio.Utterance('friends/MONICA', 'friends', "There's nothing to tell!"),
      sio.Utterance('friends/MONICA', 'friends', 'Hey, you "guys".'),
      sio.Utterance('friends/STEVE', 'friends', 'I am Steve.'),
      sio.Utterance('friends/STEVE CERA', 'friends', 'I am Steve Cera.'),
      sio.Utterance('friends/DR. LONG', 'friends', 'Dr. Long here.'),
      sio.Utterance('friends/JOEY', 'friends', 'Joey here.'),
      sio.Utterance("friends/JOEY'S DATE", 'friends', "Joey's date."),
  ]


def test_friends_short_names_never_merge(tmp_path):
  rows = [_friends_row('a', 'Mike'), _friends_row('b', 'Mike Hannigan'),
          _friends_row('c', 'Rachel Green'), _friends_row('d', 'The Waiter')]
  users = [u.user for u in sio.load_friends(_friends_dir(tmp_path, rows))]
  assert users == ['friends/MIKE', 'friends/MIKE HANNIGAN', 'friends/RACHEL',
                   'friends/THE WAITER']


# Game of Thrones.


def test_got_parse_speaker():
  assert sio.parse_got_speaker('JON (V.O.)') == 'JON'
  assert sio.parse_got_speaker('DAVOS(to JON)') == 'DAVOS'
  assert sio.parse_got_speaker('Jon Snow') == 'JON SNOW'
  assert sio.parse_got_speaker('Hugh of the Vale') == 'HUGH OF THE VALE'
  assert sio.parse_got_speaker('THE HOUND') == 'HOUND'
  assert sio.parse_got_speaker('MAN #2') == 'MAN #2'
  for not_a_speaker in ('CUT TO', 'EXT', 'INT.', "INT. King's Landing",
                        'TITLE SEQUENCECUT TO', 'Cut to', 'ALL TOGETHER',
                        'EDMURE & ROSLIN', 'JON/ROBB', 'Sam, Pyp, and Grenn',
                        'Tell me something', 'mago', '',
                        'NO SPOILERS IF YOU HAVE READ THE BOOKS',
                        'Another wave of soldiers approaches.  CERSEI'):
    assert sio.parse_got_speaker(not_a_speaker) is None, not_a_speaker


def test_got_name_map():
  mapping = sio.got_name_map([
      'JON', 'JON SNOW', 'SEPTA', 'SEPTA MORDANE', 'SEPTA UNELLA',
      'EDDARD STARK', 'PRISONER', 'PRISONER #2', 'MASTER', 'MASTER OF ARMS',
      'CERSEI', 'CERSEI BARATHEON', 'CERSEI LANNISTER'])
  assert mapping == {
      'JON': 'JON', 'JON SNOW': 'JON',
      'SEPTA': 'SEPTA', 'SEPTA MORDANE': 'SEPTA MORDANE',
      'SEPTA UNELLA': 'SEPTA UNELLA', 'EDDARD STARK': 'EDDARD STARK',
      'PRISONER': 'PRISONER', 'PRISONER #2': 'PRISONER #2',
      'MASTER': 'MASTER', 'MASTER OF ARMS': 'MASTER OF ARMS',
      'CERSEI': 'CERSEI', 'CERSEI BARATHEON': 'CERSEI BARATHEON',
      'CERSEI LANNISTER': 'CERSEI LANNISTER'}


def test_got_load_normalises_names_and_drops_directions(tmp_path):
  got = sio.load_game_of_thrones(_got_dir(tmp_path))
  assert [(u.user, u.text) for u in got] == [
      ('got/JON', "Go on. Father's watching."),  # 'Jon Snow' -> JON.
      ('got/SEPTA MORDANE', 'Fine work, as always.'),  # Ambiguous SEPTA.
      ('got/SEPTA UNELLA', 'Confess.'),
      ('got/SEPTA', 'Quiet.'),
      ('got/ROBB', 'Winter is coming. Truly.'),
      ('got/EDDARD STARK', 'I am Ned.'),  # No 'EDDARD' speaker.
      ('got/HOUND', 'Dogs.'),
      ('got/PRISONER', 'Let me go.'),
      ('got/PRISONER #2', 'Me too.'),  # Numbered role: not merged.
      ('got/JON', 'I know nothing.'),
      ('got/ROBB', 'King in the North.'),
      ('got/KHAL DROGO', 'Blood.'),  # Ambiguous KHAL.
      ('got/KHAL MORO', 'Horses.'),
      ('got/KHAL', 'Riders.'),
      ('got/HOUND', 'Chicken.'),
  ]
  assert {u.community for u in got} == {'game_of_thrones'}


def test_got_unclosed_bracket_resyncs_at_next_turn(tmp_path):
  d = _got_dir(tmp_path, {'season1/e1.txt': (
      'ARYA: One. [She turns\n'
      'and walks away\n'
      'SANSA: Two.\n')})
  assert [(u.user, u.text) for u in sio.load_game_of_thrones(d)] == [
      ('got/ARYA', 'One.'), ('got/SANSA', 'Two.')]


def test_got_episode_order(tmp_path):
  d = _got_dir(tmp_path, {'season10/e1.txt': 'A: ten\n',
                          'season2/e10.txt': 'A: two-ten\n',
                          'season2/e2.txt': 'A: two-two\n',
                          'season2/notes.txt': 'A: ignored\n'})
  assert [u.text for u in sio.load_game_of_thrones(d)] == [
      'two-two', 'two-ten', 'ten']


# Shakespeare.


def test_shakespeare_users_are_play_speaker_pairs(tmp_path):
  got = sio.load_shakespeare(_shakespeare_dir(tmp_path))
  assert got == [
      sio.Utterance('shakespeare/hamlet/HAMLET', 'hamlet',
                    'To be, or not to be.'),
      sio.Utterance('shakespeare/hamlet/GENTLEMAN', 'hamlet', 'My lord.'),
      sio.Utterance('shakespeare/hamlet/CLOWN', 'hamlet', 'A grave.'),
      sio.Utterance('shakespeare/hamlet/CLOWN', 'hamlet', 'Another grave.'),
      sio.Utterance('shakespeare/lear/GENTLEMAN', 'lear', 'Sir, the king.'),
  ]


def test_load_all_concatenates_sources(tmp_path):
  _friends_dir(tmp_path)
  _got_dir(tmp_path)
  _shakespeare_dir(tmp_path)
  got = sio.load_all(str(tmp_path))
  counts = collections.Counter(u.community for u in got)
  assert counts == {'friends': 7, 'game_of_thrones': 15, 'hamlet': 4,
                    'lear': 1}
  assert [u.community for u in got[:7]] == ['friends'] * 7


# Errors.


def test_missing_friends_file_names_it(tmp_path):
  path = os.path.join(tmp_path, 'friends', 'friends.tsv.gz')
  with pytest.raises(sio.SpeakerDataError, match='not found') as e:
    sio.load_friends(os.path.join(tmp_path, 'friends'))
  assert path in str(e.value)


def test_missing_column_names_file_and_column(tmp_path):
  header = [c for c in sio.SHAKESPEARE_COLUMNS if c != 'speaker']
  d = _shakespeare_dir(tmp_path, [r[:5] + r[6:] for r in SHAKESPEARE_ROWS],
                       header)
  with pytest.raises(sio.SpeakerDataError) as e:
    sio.load_shakespeare(d)
  msg = str(e.value)
  assert os.path.join(d, 'shakespeare.tsv.gz') in msg
  assert "['speaker']" in msg and 'lacks column' in msg


def test_bad_gzip_names_file(tmp_path):
  path = _write(os.path.join(tmp_path, 'friends', 'friends.tsv.gz'),
                'text\tspeaker\nnot gzipped\tMonica\n')
  with pytest.raises(sio.SpeakerDataError, match='not a readable gzip') as e:
    sio.load_friends(os.path.join(tmp_path, 'friends'))
  assert path in str(e.value)


def test_truncated_gzip_names_file(tmp_path):
  d = _friends_dir(tmp_path)
  path = os.path.join(d, 'friends.tsv.gz')
  with open(path, 'rb') as f:
    data = f.read()
  with open(path, 'wb') as f:
    f.write(data[:len(data) // 2])
  with pytest.raises(sio.SpeakerDataError, match='gzip') as e:
    sio.load_friends(d)
  assert path in str(e.value)


def test_wrong_field_count_names_file_and_line(tmp_path):
  rows = [_friends_row('ok', 'Monica'), ['short row', 'Ross']]
  d = _friends_dir(tmp_path, rows)
  with pytest.raises(sio.SpeakerDataError, match='line 3: 2 fields') as e:
    sio.load_friends(d)
  assert os.path.join(d, 'friends.tsv.gz') in str(e.value)


def test_no_usable_lines(tmp_path):
  d = _friends_dir(tmp_path, [_friends_row('(exits)', 'Scene Directions')])
  with pytest.raises(sio.SpeakerDataError, match='no usable lines') as e:
    sio.load_friends(d)
  assert 'friends.tsv.gz' in str(e.value)
  d = _got_dir(tmp_path, {'season1/e1.txt': '[Blackout]\nEXT. WOODS\n',
                          'season1/e2.txt': ''})
  with pytest.raises(sio.SpeakerDataError, match='no usable lines') as e:
    sio.load_game_of_thrones(d)
  assert d in str(e.value)


def test_got_missing_folder_or_files(tmp_path):
  d = os.path.join(tmp_path, 'game_of_thrones')
  with pytest.raises(sio.SpeakerDataError, match='not found') as e:
    sio.load_game_of_thrones(d)
  assert d in str(e.value)
  os.makedirs(os.path.join(d, 'season1'))
  with pytest.raises(sio.SpeakerDataError, match='no seasonN/eM.txt') as e:
    sio.load_game_of_thrones(d)


def test_got_non_utf8_names_file(tmp_path):
  d = _got_dir(tmp_path, {'season1/e1.txt': 'JON: hi\n'})
  path = os.path.join(d, 'season1', 'e2.txt')
  with open(path, 'wb') as f:
    f.write(b'JON: \xff\xfe bad\n')
  with pytest.raises(sio.SpeakerDataError) as e:
    sio.load_game_of_thrones(d)
  assert path in str(e.value)


def test_load_all_missing_root_or_source(tmp_path):
  with pytest.raises(sio.SpeakerDataError, match='Data root'):
    sio.load_all(os.path.join(tmp_path, 'nope'))
  _friends_dir(tmp_path)
  _got_dir(tmp_path)
  with pytest.raises(sio.SpeakerDataError, match='shakespeare.tsv.gz'):
    sio.load_all(str(tmp_path))


# Real data (skipped when ../shared/data is absent).


@pytest.fixture(scope='module')
def real_root():
  if not os.path.isdir(os.path.join(DATA_ROOT, 'friends')):
    pytest.skip(f'Real transcripts not found under {DATA_ROOT}')
  return DATA_ROOT


def test_real_friends(real_root):
  path = os.path.join(real_root, 'friends', 'friends.tsv.gz')
  rows = list(sio.read_tsv(path, sio.FRIENDS_COLUMNS))
  assert len(rows) == 67359  # README.
  named = [r for r in rows
           if r['speaker'] not in ('', '#ALL#', 'Scene Directions')]
  assert len(named) == 60676  # README: one named speaker.
  got = sio.load_friends(os.path.join(real_root, 'friends'))
  assert len(got) == 60657  # Minus 19 by 'Both' / 'Together'.
  counts = collections.Counter(u.user for u in got)
  assert len(counts) == 695
  assert counts['friends/RACHEL'] == 9307
  assert counts['friends/MONICA'] == 8440
  assert counts['friends/JOEY TRIBBIANI'] == 8171  # 'Joey Tribbiani Sr.'.
  assert not any(u.startswith(('friends/SCENE', 'friends/#'))
                 for u in counts)


def test_real_game_of_thrones(real_root):
  d = os.path.join(real_root, 'game_of_thrones')
  files = sio.got_episode_files(d)
  assert len(files) == 75
  turns = {}
  for path in files:
    with open(path, encoding='utf-8') as f:
      turns[os.path.relpath(path, d)] = list(sio.got_turns(f.read()))
  empty = sorted(name for name, t in turns.items() if not t)
  assert empty == ['season4/e11.txt', 'season5/e11.txt', 'season8/e3.txt',
                   'season8/e5.txt']  # README placeholders; 71 with content.
  got = sio.load_game_of_thrones(d)
  assert len(got) == 23824  # README: about 23,900 speaker lines.
  counts = collections.Counter(u.user for u in got)
  assert len(counts) == 631
  for pseudo in ('got/CUT TO', 'got/EXT', 'got/INT', 'got/JON SNOW',
                 'got/TITLE SEQUENCE'):
    assert pseudo not in counts
  assert counts['got/JON'] == 1119  # 'JON' + 'Jon Snow' + 'JON SNOW' lines.
  assert all('\u2019' not in u.text and u.text for u in got)


def test_real_shakespeare(real_root):
  path = os.path.join(real_root, 'shakespeare', 'shakespeare.tsv.gz')
  rows = list(sio.read_tsv(path, sio.SHAKESPEARE_COLUMNS))
  assert len(rows) == 30876  # README.
  assert len({r['play'] for r in rows}) == 37
  assert len({(r['play'], r['speaker']) for r in rows}) == 1377
  got = sio.load_shakespeare(os.path.join(real_root, 'shakespeare'))
  assert len(got) == 30746
  users = collections.Counter(u.user for u in got)
  assert len(users) == 1326
  assert len({u.community for u in got}) == 37
  assert users['shakespeare/hamlet/HAMLET'] == 359
  # Same name in 7 plays: 7 users.
  gloucester = {u: n for u, n in users.items()
                if u.endswith('/GLOUCESTER')}
  assert gloucester == {
      'shakespeare/1henryvi/GLOUCESTER': 48,
      'shakespeare/2henryiv/GLOUCESTER': 10,
      'shakespeare/2henryvi/GLOUCESTER': 69,
      'shakespeare/3henryvi/GLOUCESTER': 66,
      'shakespeare/henryv/GLOUCESTER': 5,
      'shakespeare/lear/GLOUCESTER': 118,
      'shakespeare/richardiii/GLOUCESTER': 163}
