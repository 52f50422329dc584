"""The playground page's files (HTML, CSS, JavaScript), served by api/routes/playground.py."""
